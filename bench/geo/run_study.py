#!/usr/bin/env python3
"""The geo-distributed study at small scale: the same job, several parallel plans, emulated WANs.

For each inter-site one-way latency (0, 10, 30, 100 ms) and bandwidth (1000 and 100 Mbit/s), brings up
two sites of two workers with `geotrain cluster up` (the WAN emulator between them) and runs the same
training job with: DP across sites, PP across sites, DP x PP with the pipeline across sites (gradients
all-reduced inside sites), DP x PP with replicas per site (gradients all-reduced across sites), each
lossless and, for the plans that send gradients or activations across sites, with a bf16 WAN codec.
Records the median step time (steps after the first), tokens/s and WAN bytes per step in a CSV, and
draws PNG figures.

Usage: /usr/bin/python3 bench/geo/run_study.py [--geotrain build/bin/geotrain] [--out docs/results/data/geo]
                                               [--steps 6] [--latencies 0,10,30,100] [--bandwidths 1000,100]
From the checkout, with PYTHONPATH=tests/lib (the shared code: geotrain_testing).
"""
import argparse
import csv
import os
import shutil
import statistics
import subprocess

from geotrain_testing.clusters import private_cluster_env, run
from geotrain_testing.logs import cluster_steps
from geotrain_testing.shards import write_pattern_shard

PLANS = [
    # name, parallel section, description
    ("dp4-across-sites", "{plan: manual, dp: 4, microbatches: 1}", "DP=4, the ring crosses sites"),
    ("pp4-across-sites", "{plan: manual, pp: 4, microbatches: 8, schedule: 1f1b}", "PP=4, one stage boundary crosses sites"),
    ("dp2xpp2-pipeline-across", "{plan: manual, dp: 2, pp: 2, microbatches: 4, schedule: 1f1b, placement: "
     "[{replica: 0, stage: 0, site: a}, {replica: 1, stage: 0, site: a}, {replica: 0, stage: 1, site: b}, "
     "{replica: 1, stage: 1, site: b}]}", "DP2 x PP2: pipelines span sites, DP inside sites"),
    ("dp2xpp2-dp-across", "{plan: manual, dp: 2, pp: 2, microbatches: 4, schedule: 1f1b, placement: "
     "[{replica: 0, stage: 0, site: a}, {replica: 0, stage: 1, site: a}, {replica: 1, stage: 0, site: b}, "
     "{replica: 1, stage: 1, site: b}]}", "DP2 x PP2: pipelines inside sites, DP across sites"),
]
CODECS = ["none", "bf16"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geotrain", default="build/bin/geotrain")
    ap.add_argument("--out", default="docs/results/data/geo")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--latencies", default="0,10,30,100")
    ap.add_argument("--bandwidths", default="1000,100")
    ap.add_argument("--report-only", action="store_true", help="redraw figures and the table from the CSV")
    args = ap.parse_args()
    if args.report_only:
        with open(os.path.join(args.out, "geo_study.csv")) as f:
            rows = [dict(r, latency_ms=float(r["latency_ms"]), bandwidth_mbps=float(r["bandwidth_mbps"]),
                         step_s_median=float(r["step_s_median"]), tokens_per_s_median=float(r["tokens_per_s_median"]),
                         wan_bytes_per_step=float(r["wan_bytes_per_step"])) for r in csv.DictReader(f)]
        plot(rows, args.out)
        report(rows, args.out)
        return
    geotrain = os.path.abspath(args.geotrain)
    os.makedirs(args.out, exist_ok=True)
    work, env = private_cluster_env("geotrain_geo_")
    data = os.path.join(work, "train_000000.bin")
    write_pattern_shard(data, 200000, 512)
    rows = []
    csv_path = os.path.join(args.out, "geo_study.csv")
    try:
        for bw in [float(x) for x in args.bandwidths.split(",")]:
            for lat in [float(x) for x in args.latencies.split(",")]:
                topo = os.path.join(work, f"topo-{lat}-{bw}.yaml")
                with open(topo, "w") as f:
                    f.write("sites:\n  - {name: a, workers: [{device: RTX6000}, {device: RTX6000}]}\n"
                            "  - {name: b, workers: [{device: RTX6000}, {device: RTX6000}]}\n"
                            f"links:\n  - {{a: a, b: b, latency_ms: {lat}, bandwidth_mbps: {bw}, jitter_ms: 0}}\n")
                run([geotrain, "cluster", "up", topo], env)
                try:
                    for name, parallel, _ in PLANS:
                        for codec in CODECS:
                            spec = os.path.join(work, f"{name}-{codec}.yaml")
                            with open(spec, "w") as f:
                                f.write(f"name: {name}-{codec}\n"
                                        "model: {n_layer: 4, n_head: 4, n_embd: 128, block_size: 64, vocab_size: 512}\n"
                                        f"data: {{train: '{data}'}}\n"
                                        f"train: {{global_batch: 16, seq_len: 64, steps: {args.steps}, lr: 1.0e-3, seed: 1}}\n"
                                        f"parallel: {parallel}\ncomm: {{wan_codec: {codec}}}\n")
                            out = run([geotrain, "job", "submit", spec, "--follow"], env)
                            steps = [(s["tokens_per_s"], s["step_s"], s["wan_bytes"]) for s in cluster_steps(out)]
                            if len(steps) != args.steps:
                                raise RuntimeError(f"{name}/{codec}: expected {args.steps} steps:\n{out}")
                            later = steps[1:] if len(steps) > 1 else steps
                            row = {"latency_ms": lat, "bandwidth_mbps": bw, "plan": name, "codec": codec,
                                   "step_s_median": statistics.median(s[1] for s in later),
                                   "tokens_per_s_median": statistics.median(s[0] for s in later),
                                   "wan_bytes_per_step": statistics.median(s[2] for s in later)}
                            rows.append(row)
                            print(",".join(str(v) for v in row.values()), flush=True)
                            with open(csv_path, "w", newline="") as f:
                                w = csv.DictWriter(f, fieldnames=list(row))
                                w.writeheader()
                                w.writerows(rows)
                finally:
                    subprocess.run([geotrain, "cluster", "down"], env=env, capture_output=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plot(rows, args.out)
    report(rows, args.out)


def report(rows, out):
    # One markdown table: per network, each plan's median step time and its ratio to the fastest plan.
    lines = ["| bandwidth | latency | " + " | ".join(f"{p[0]} {c}" for p in PLANS for c in CODECS) +
             " | fastest | DP-across-sites / fastest |",
             "|" + "---|" * (3 + len(PLANS) * len(CODECS) + 1)]
    for bw in sorted({r["bandwidth_mbps"] for r in rows}, reverse=True):
        for lat in sorted({r["latency_ms"] for r in rows}):
            cell = {(r["plan"], r["codec"]): r for r in rows if r["bandwidth_mbps"] == bw and r["latency_ms"] == lat}
            if not cell:
                continue
            best = min(cell.values(), key=lambda r: r["step_s_median"])
            dp = cell.get(("dp4-across-sites", "none"))
            values = [f"{cell[(p[0], c)]['step_s_median']:.2f} s" if (p[0], c) in cell else "-"
                      for p in PLANS for c in CODECS]
            ratio = f"{dp['step_s_median'] / best['step_s_median']:.2f}x" if dp else "-"
            lines.append(f"| {bw:.0f} Mbit/s | {lat:.0f} ms | " + " | ".join(values) +
                         f" | {best['plan']} {best['codec']} | {ratio} |")
    lines.append("")
    lines.append("| plan | codec | WAN bytes per step |")
    lines.append("|---|---|---|")
    for p in PLANS:
        for c in CODECS:
            vals = sorted({r["wan_bytes_per_step"] for r in rows if r["plan"] == p[0] and r["codec"] == c})
            if vals:
                lines.append(f"| {p[0]} | {c} | {vals[len(vals) // 2] / 1e6:.2f} MB |")
    with open(os.path.join(out, "geo_study_table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(rows, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for bw in sorted({r["bandwidth_mbps"] for r in rows}, reverse=True):
        plt.figure(figsize=(7, 4))
        for name, _, desc in PLANS:
            for codec, style in (("none", "-"), ("bf16", "--")):
                pts = sorted((r["latency_ms"], r["step_s_median"]) for r in rows
                             if r["bandwidth_mbps"] == bw and r["plan"] == name and r["codec"] == codec)
                if pts:
                    plt.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                             label=f"{desc}{' (bf16 WAN)' if codec == 'bf16' else ''}")
        plt.xlabel("one-way latency between sites (ms)")
        plt.ylabel("median step time (s)")
        plt.title(f"same job, 4 workers in 2 sites, {bw:.0f} Mbit/s between sites", fontsize=10)
        plt.grid(alpha=0.3)
        plt.legend(fontsize=6)
        plt.tight_layout()
        plt.savefig(os.path.join(out, f"geo_step_time_{int(bw)}mbps.png"), dpi=120)
        plt.close()


if __name__ == "__main__":
    main()
