#!/usr/bin/env python3
"""EMULATED: the planner validated at scale on timed clusters (issue 17 point 3).

Topologies of three sites with mixed emulated GPUs (FABRIC's RTX 6000, A30 and T4), different links, and 8 to 16
devices, brought up with `geotrain cluster up --timed-compute`. The planner is calibrated to this machine
(geotrain_testing.timed; nothing is fitted across sites): the device efficiencies from the timed backend, and per
topology the bandwidth inside a site for gradients and for activations from two profiling jobs (DP2 and TP2) on the
topology's own cluster (timed.refit_inside_site), since this host's loopback drifts between spells of minutes: a
round of them before the plans, whose fit ranks them, and one between each later round of the plans; the
predictions reported use the median of all those rounds (the first round's are in the CSV too). --no-refit fits
those bandwidths once instead, on a separate profiling cluster, for every topology.
The topologies' links are their configured ones. Per topology, the calibrated planner (`geotrain plan --job`, as the
head plans `plan: auto`) ranks plans; its top --top plans run, and so do DP over every device
and TP inside each site x PP across the sites. For each run: the measured step (median of the steps after the
warm-up: 12 steps skipping 3 when the step is short, 3 skipping 1 when it is long, 2 skipping 1 from 20 s,
timed.steady_steps; a plan with a short step runs --rounds jobs, interleaved with the topology's other short
plans and its profiling rounds, and reports their median: timed.measure_plans) and the planner's prediction of
that very plan (`geotrain plan --predict`). Criteria (issue 17): median relative error
<= 10%, Spearman >= 0.9 over all runs, and the chosen plan within 5% of the best measured on every topology. Writes
CSV, a markdown table, a PNG and the calibrations (-calibration.json) to --out (default
docs/results/data/geo/validation-timed).
Every figure is EMULATED.

Usage: /usr/bin/python3 bench/geo/validate_timed.py [--geotrain build/bin/geotrain]
           [--out docs/results/data/geo/validation-timed]
           [--model gpt2-medium] [--steps 3 (calibration)] [--top 3] [--topologies t8,t12,t16]
           [--rounds 3] [--no-refit]
From the checkout, with PYTHONPATH=tests/lib (the shared code: geotrain_testing).
"""
import argparse
import csv
import json
import os
import shutil
import statistics
import tempfile
import time

from geotrain_testing import timed
from geotrain_testing.clusters import ClusterUp
from geotrain_testing.shards import write_tiny_corpus
from validate_planner import spearman  # bench/geo/, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (sites [(site, [(device, devices per worker), ...])], links [(a, b, one-way ms, Mbit/s)], WAN codec,
# global batch: a multiple of the device count, so that DP over every device runs)
TOPOLOGIES = {
    "t8": ([("utah", [("RTX6000", 2), ("RTX6000", 2)]), ("tacc", [("A30", 2)]), ("star", [("T4", 2)])],
           [("utah", "tacc", 12, 1000), ("utah", "star", 14, 1000), ("tacc", "star", 11, 500)], "bf16", 16),
    "t12": ([("utah", [("RTX6000", 2), ("RTX6000", 2)]), ("amst", [("A30", 2), ("A30", 2)]), ("star", [("T4", 2), ("T4", 2)])],
            [("utah", "amst", 51.5, 1000), ("utah", "star", 14, 2000), ("amst", "star", 45, 1000)], "int8", 24),
    "t16": ([("utah", [("RTX6000", 3), ("RTX6000", 3)]), ("tacc", [("A30", 3), ("A30", 3)]), ("star", [("T4", 2), ("T4", 2)])],
            [("utah", "tacc", 12, 10000), ("utah", "star", 14, 10000), ("tacc", "star", 11, 10000)], "bf16", 16),
}
def fixed_plans(sites, batch):
    """DP over every device, and TP inside each site x PP across the sites (stage s in site s)."""
    devices = [(name, w, d) for name, workers in sites for w, (_, n) in enumerate(workers) for d in range(n)]
    n = len(devices)
    dp = "{plan: manual, dp: %d, microbatches: %d}" % (n, max(1, batch // n))
    tp = min(sum(c for _, c in workers) for _, workers in sites)
    tp = 1 << (tp.bit_length() - 1)  # a power of two every site has
    place = ", ".join(f"{{replica: 0, stage: {s}, tp_rank: {t}, site: {name}}}"
                      for s, (name, _) in enumerate(sites) for t in range(tp))
    tpxpp = (f"{{plan: manual, tp: {tp}, pp: {len(sites)}, microbatches: 8, schedule: 1f1b, "
             f"placement: [{place}]}}")
    return [("dp-all", dp), (f"tp{tp}-in-site-x-pp{len(sites)}", tpxpp)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geotrain", default=os.path.join(ROOT, "build", "bin", "geotrain"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "data", "geo", "validation-timed"))
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--steps", type=int, default=3, help="steps of the calibration's jobs, at least")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--topologies", default="t8,t12,t16")
    ap.add_argument("--job-timeout", type=float, default=1200)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of each plan with a short step, interleaved; its step is their median")
    ap.add_argument("--no-refit", action="store_true",
                    help="predict every topology with the profiling cluster's calibration (no refit on its cluster)")
    args = ap.parse_args()

    def up(topology):
        return ClusterUp(args.geotrain, topology, prefix="geotrain_validate_timed_", up_args=["--timed-compute"])

    work = tempfile.mkdtemp(prefix="geotrain_validate_timed_")
    try:
        validate(args, work, up)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def validate(args, work, up):
    """Calibrates, then runs each topology's plans on its own cluster (after the refit) and writes the report."""
    data = write_tiny_corpus(os.path.join(work, "data"), vocab=50000, length=4096, repeats=20)
    started = time.monotonic()
    calibration = timed.calibrate(args.geotrain, up, work, data, args.model, ["RTX6000", "A30", "T4"],
                                  "RTX6000", args.steps, args.job_timeout, inside_site=args.no_refit)
    print(f"[{time.monotonic() - started:6.0f} s] calibration: {json.dumps(calibration)}", flush=True)
    rows, refits = [], {}
    for name in args.topologies.split(","):
        sites, links, codec, batch = TOPOLOGIES[name]
        topo = os.path.join(work, f"{name}.yaml")
        timed.write_topology(topo, sites, links)
        c = up(topo)
        try:
            cal, profile, refit_rounds = calibration, None, []
            if not args.no_refit:
                def profile(c=c, topo=topo, site=sites[0][0], name=name):
                    timed.add_profiling_round(
                        refit_rounds, c, topo, site, work, data, args.model, args.steps, args.job_timeout,
                        lambda text: print(f"[{time.monotonic() - started:6.0f} s] {name}: {text}", flush=True))
                profile()
                cal = timed.refit_inside_site(args.geotrain, topo, calibration, refit_rounds)
                print(f"[{time.monotonic() - started:6.0f} s] {name}: refitted inside {sites[0][0]}: "
                      f"{cal['intra_site_gbps']:.2f} Gbit/s for gradients, "
                      f"{cal['intra_site_activation_gbps']:.2f} for activations (ranks the plans)", flush=True)
            flags = timed.planner_flags(cal)
            auto = os.path.join(work, f"{name}-auto.yaml")
            timed.write_job(auto, "auto", args.model, data, "{plan: auto}", args.steps, batch, codec)
            ranked = timed.plan_json(args.geotrain, topo, auto, flags, top=args.top)["ranked"][:args.top]
            plans = ([(f"planner-{i + 1}", timed.parallel_of(p)) for i, p in enumerate(ranked)] +
                     fixed_plans(sites, batch))
            jobs = []
            for label, parallel in plans:
                spec = os.path.join(work, f"{name}-{label}.yaml")

                def write_spec(steps, label=label, parallel=parallel, spec=spec):
                    timed.write_job(spec, f"{name}-{label}", args.model, data, parallel, steps, batch, codec)
                jobs.append((spec, write_spec))

            def progress(i, measured, name=name, plans=plans):
                print(f"EMULATED [{time.monotonic() - started:6.0f} s] {name} {plans[i][0]}: {measured['state']} "
                      f"{measured['step_s']} s per step", flush=True)
            measured = timed.measure_plans(c, args.geotrain, topo, flags, jobs, args.job_timeout, args.rounds,
                                           progress, between_rounds=profile)
            if len(refit_rounds) > 1:
                # The prediction of every plan from the median of all the profiling rounds: the jobs that sampled
                # the host while the plans ran, none of them a plan.
                first = cal
                cal = timed.refit_inside_site(args.geotrain, topo, calibration, refit_rounds)
                cal["first_round"] = {k: first[k] for k in ("intra_site_gbps", "intra_site_activation_gbps")}
                print(f"[{time.monotonic() - started:6.0f} s] {name}: refitted on {len(refit_rounds)} rounds: "
                      f"{cal['intra_site_gbps']:.2f} Gbit/s for gradients, "
                      f"{cal['intra_site_activation_gbps']:.2f} for activations (predicts them)", flush=True)
                final = timed.planner_flags(cal)
                for (spec, _), m in zip(jobs, measured):
                    m["predicted_first_round_s"] = m["predicted_s"]
                    if m["predicted_s"] != "":
                        try:
                            m["predicted_s"] = round(timed.predict(args.geotrain, topo, spec, final), 4)
                        except RuntimeError as e:  # kept with the first round's prediction, and said
                            m["message"] = (m["message"] + f" final fit cannot predict it: {e}")[:300]
            for m in measured:
                m.setdefault("predicted_first_round_s", m["predicted_s"])
            if not args.no_refit:
                refits[name] = cal
            for (label, parallel), m in zip(plans, measured):
                row = {"topology": name, "plan": label, "parallel": parallel}
                row.update(m)
                rows.append(row)
                print(f"EMULATED [{time.monotonic() - started:6.0f} s] " + json.dumps(row), flush=True)
        finally:
            c.close()
    report(rows, calibration, refits, args, time.monotonic() - started)


def report(rows, calibration, refits, args, seconds):
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + "-calibration.json", "w") as f:
        json.dump({"base": calibration, "refitted_per_topology": refits}, f, indent=1)
    fields = ["topology", "plan", "state", "step_s", "predicted_s", "predicted_first_round_s", "compute_s",
              "comm_wait_s", "wan_mb", "wall_s", "rounds_s", "parallel", "message"]
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    ok = [r for r in rows if r["step_s"] != "" and r["predicted_s"] != ""]
    errors = [abs(r["predicted_s"] - r["step_s"]) / r["step_s"] for r in ok]
    rho = spearman([r["predicted_s"] for r in ok], [r["step_s"] for r in ok]) if len(ok) > 2 else float("nan")
    def inside(cal):
        rounds = cal.get("measured_rounds", {}).get("dp2", [])
        first = cal.get("first_round")
        return (f"{cal['intra_site_gbps']:.2f} Gbit/s for gradients, "
                f"{cal.get('intra_site_activation_gbps') or cal['intra_site_gbps']:.2f} Gbit/s for activations" +
                (f" (median of {len(rounds)} profiling rounds; the first alone, which ranked the plans: "
                 f"{first['intra_site_gbps']:.2f} and {first['intra_site_activation_gbps']:.2f})"
                 if first and len(rounds) > 1 else ""))
    profiled = f", inside a site {inside(calibration)} on the profiling cluster" if "measured" in calibration else ""
    lines = [f"EMULATED (timed compute), {args.model}, global batch 16-24 x 1024 (a multiple of the devices); calibration: "
             f"efficiency {', '.join(f'{k} {v:.3f}' for k, v in calibration['efficiency'].items())}{profiled}, "
             f"latency inside a site {calibration['intra_site_latency_ms']:.3f} ms, nothing fitted across sites" +
             "".join(f"; {name} refitted on its own cluster: {inside(cal)}" for name, cal in refits.items()), "",
             "| topology | plan | measured s | predicted s | error | WAN MB/step | rounds (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{100 * (r['predicted_s'] - r['step_s']) / r['step_s']:+.0f}%" if r in ok else r["state"]
        lines.append(f"| {r['topology']} | {r['plan']} | {r['step_s']} | {r['predicted_s']} | {err} | {r['wan_mb']} | "
                     f"{r.get('rounds_s', '').replace(';', ', ') or '-'} |")
    chosen_ok = []
    for name in sorted({r["topology"] for r in rows}):
        got = [r for r in rows if r["topology"] == name and r["step_s"] != ""]
        chosen = next((r for r in got if r["plan"] == "planner-1"), None)
        if got and chosen:
            best = min(got, key=lambda r: r["step_s"])
            chosen_ok.append((name, chosen["step_s"] / best["step_s"], best["plan"]))
    lines += ["", f"Over {len(ok)} runs: median relative error {100 * statistics.median(errors):.1f}% (goal <= 10%), "
              f"Spearman {rho:.2f} (goal >= 0.9); chosen plan / best measured: " +
              ", ".join(f"{n} {x:.2f} (best {b})" for n, x, b in chosen_ok) + " (goal <= 1.05 each). "
              f"Whole run {seconds / 60:.1f} min."] if errors else ["", "no run succeeded"]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name in sorted({r["topology"] for r in ok}):
        pts = [(r["predicted_s"], r["step_s"]) for r in ok if r["topology"] == name]
        ax.scatter([p for p, _ in pts], [m for _, m in pts], label=name)
    if ok:
        lo = min(min(r["predicted_s"], r["step_s"]) for r in ok) * 0.8
        hi = max(max(r["predicted_s"], r["step_s"]) for r in ok) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("predicted step (s)")
    ax.set_ylabel("measured step (s, EMULATED GPUs)")
    ax.set_title("planner vs timed clusters (EMULATED)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
