#!/usr/bin/env python3
"""Latency-tolerant pipelines (issue 16 point 4): PP=2 across a 50 ms one-way link against the same job at 0 ms.

Brings up two sites of one CPU worker each (described as a 0.1 TFLOP/s "cpu-core") with `geotrain cluster up` (the WAN emulator between them) at each
one-way latency, and runs the same PP=2 job (stage 0 in site a, stage 1 in site b, 1F1B) twice: with plain
1F1B (`pipeline_depth` = pp) and with the depth the head chooses from the measured link and the predicted
microbatch time (`pipeline_depth` absent). Every run trains on the same tokens; each worker computes on one
core (OMP_NUM_THREADS=1), so the two stages do not share cores. Records the median step time
after the first step, the depth the head chose (from the job log) and the ratio to the 0 ms run of the
same mode, in a CSV and a Markdown table.

Usage: /usr/bin/python3 bench/geo/pipeline_depth.py [--geotrain build/bin/geotrain] [--out docs/results/data/geo]
                                                     [--steps 5] [--latencies 0,50] [--microbatches 192]
From the checkout, with PYTHONPATH=tests/lib (the shared code: geotrain_testing).
"""
import argparse
import csv
import os
import re
import shutil
import statistics
import subprocess

from geotrain_testing.clusters import private_cluster_env, run
from geotrain_testing.logs import cluster_steps
from geotrain_testing.shards import write_pattern_shard

MODEL = "{n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab_size: 512}"
# A CPU worker described by its speed (about one core of this machine's, so that the head's predicted
# microbatch time is the CPU's order of magnitude): the CPU computes.
WORKER = "{device: cpu-core, tflops: 0.1, mem_gb: 8}"
PLACEMENT = "[{replica: 0, stage: 0, site: a}, {replica: 0, stage: 1, site: b}]"


def job_spec(path, name, data, steps, microbatches, depth):
    depth_field = f", pipeline_depth: {depth}" if depth else ""
    with open(path, "w") as f:
        f.write(f"name: {name}\nmodel: {MODEL}\ndata: {{train: '{data}'}}\n"
                f"train: {{global_batch: {microbatches}, seq_len: 128, steps: {steps}, lr: 1.0e-3, seed: 1}}\n"
                f"parallel: {{plan: manual, pp: 2, microbatches: {microbatches}, schedule: 1f1b{depth_field}, "
                f"placement: {PLACEMENT}}}\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geotrain", default="build/bin/geotrain")
    ap.add_argument("--out", default="docs/results/data/geo")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--latencies", default="0,50")
    ap.add_argument("--microbatches", type=int, default=192)
    args = ap.parse_args()
    geotrain = os.path.abspath(args.geotrain)
    os.makedirs(args.out, exist_ok=True)
    # One core per stage, as on separate nodes: on this 2-core machine two stages that each took both cores
    # would speed each other up whenever one waits on the link, hiding the very stall this measures.
    work, env = private_cluster_env("geotrain_depth_", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    data = os.path.join(work, "train_000000.bin")
    write_pattern_shard(data, 400000, 512)
    rows = []
    try:
        for lat in [float(x) for x in args.latencies.split(",")]:
            topo = os.path.join(work, f"topo-{lat}.yaml")
            with open(topo, "w") as f:
                f.write(f"sites:\n  - {{name: a, workers: [{WORKER}]}}\n  - {{name: b, workers: [{WORKER}]}}\n"
                        f"links:\n  - {{a: a, b: b, latency_ms: {lat}, bandwidth_mbps: 1000, jitter_ms: 0}}\n")
            run([geotrain, "cluster", "up", topo], env)
            try:
                for mode, depth in (("plain 1F1B (depth = pp)", 2), ("depth chosen by the head", 0)):
                    spec = os.path.join(work, f"pp2-{lat}-{depth}.yaml")
                    job_spec(spec, f"pp2-depth{depth}", data, args.steps, args.microbatches, depth)
                    out = run([geotrain, "job", "submit", spec, "--follow"], env)
                    steps = [s["step_s"] for s in cluster_steps(out)]
                    if len(steps) != args.steps:
                        raise RuntimeError(f"{mode} at {lat} ms: expected {args.steps} steps:\n{out}")
                    chosen = re.search(r"1F1B pipeline depth (\d+)", out)
                    row = {"latency_ms": lat, "mode": mode, "depth": int(chosen.group(1)) if chosen else 2,
                           "microbatches": args.microbatches, "step_s_median": statistics.median(steps[1:]),
                           "steps": ";".join(f"{s:.3f}" for s in steps)}
                    rows.append(row)
                    print(",".join(str(v) for v in row.values()), flush=True)
            finally:
                subprocess.run([geotrain, "cluster", "down"], env=env, capture_output=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(os.path.join(args.out, "pipeline_depth.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    base = {r["mode"]: r["step_s_median"] for r in rows if r["latency_ms"] == 0}
    lines = ["| one-way latency | mode | depth | median step (s) | vs 0 ms |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = r["step_s_median"] / base[r["mode"]] if r["mode"] in base else float("nan")
        lines.append(f"| {r['latency_ms']:.0f} ms | {r['mode']} | {r['depth']} | {r['step_s_median']:.3f} | "
                     f"{ratio:.2f}x |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "pipeline_depth.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
