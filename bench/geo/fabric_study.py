#!/usr/bin/env python3
"""EMULATED: the FABRIC study's experiment (GPT-2 medium and large, Utah-Amsterdam) on timed compute.

"Performance of Small Language Model Pretraining on FABRIC" found data parallelism across Utah and Amsterdam
(103 ms round trip) 13.75x slower than its pipeline+shard plan. This runs the same question on a timed cluster
(docs/timed-compute.md): two sites of --devices emulated GPUs each (default 2x A40, FABRIC's 48 GB GPU, so that a GPT-2 large replica fits),
one WAN link of --bandwidth-mbps at each round trip of --rtt-ms (0, 10, 30, 103), and for each model these plans:

  dp        DP over all devices: the gradient all-reduce crosses the WAN
  pp        PP over all devices, 1F1B: one stage boundary crosses the WAN
  dpxpp     DP inside each site x PP across the sites: activations cross the WAN, gradients stay in a site
  tpxpp     TP inside each site x PP across the sites (the study's pipeline + shard plan)
  auto      the planner's choice (plan: auto) on the cluster as it is

All plans send bf16 across the WAN. For each run: the median step time of the steps after the warm-up
(timed.steady_steps), the emulated compute, and WAN bytes per step; and the planner's prediction of that very plan (`geotrain plan
--predict`), so that the table shows how far the planner is from what ran. Writes CSV, a markdown table and a PNG
to --out (default docs/results/data/geo/fabric). Every figure is EMULATED: the GPUs' compute is waited, not run; the
communication (gRPC, codecs, the WAN emulator) really runs, on this machine's cores.

Usage: /usr/bin/python3 bench/geo/fabric_study.py [--geotrain build/bin/geotrain] [--out docs/results/data/geo/fabric]
           [--models gpt2-medium,gpt2-large] [--rtt-ms 0,10,30,103] [--plans dp,pp,dpxpp,tpxpp,auto] [--steps 3]
           [--calibration docs/results/data/geo/fabric-calibration.json]
From the checkout, with PYTHONPATH=tests/lib (the shared code: geotrain_testing).
Calibration (geotrain_testing.timed): the A40's efficiency from the timed backend; the bandwidths inside a site
from the profiling jobs inside a site (DP2 and TP2 on utah's two devices), one round of them on each round trip's
own cluster before its plans. The plans of a round trip are ranked (auto) and first predicted with the fit to the
median of the rounds so far; once every round trip has run, every plan is predicted again with the fit to the
median of all the rounds (predicted_s; the first prediction is predicted_first_s). One round of those jobs varies
by about 10% from the next on this host, and a single round's error went into every prediction (2026-12-05
21:42 UTC: one round on a profiling cluster fitted 10-20% more bandwidth than at 19:12, and tpxpp came out 15-29%
fast). Nothing is fitted across sites: the links are the topology's.
--calibration reuses a calibration this script wrote instead of profiling (about 5 minutes in all), for a quick
rerun of some plans; the plans run in the order given, all of one round trip on one cluster.
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SITES = ("utah", "amsterdam")


def parallel_section(plan, devices, batch):
    """The spec's parallel section of a plan on two sites of `devices` devices each (placement by site)."""
    n = 2 * devices
    if plan == "dp":  # one sequence per microbatch, so that a GPT-2 large replica fits a 24 GB GPU
        return f"{{plan: manual, dp: {n}, microbatches: {max(1, batch // n)}}}"
    if plan == "pp":
        place = ", ".join(f"{{replica: 0, stage: {s}, site: {SITES[s // devices]}}}" for s in range(n))
        return f"{{plan: manual, pp: {n}, microbatches: {2 * n}, schedule: 1f1b, placement: [{place}]}}"
    if plan == "dpxpp":
        place = ", ".join(f"{{replica: {r}, stage: {s}, site: {SITES[s]}}}" for r in range(devices) for s in (0, 1))
        return f"{{plan: manual, dp: {devices}, pp: 2, microbatches: 4, schedule: 1f1b, placement: [{place}]}}"
    if plan == "tpxpp":
        place = ", ".join(f"{{replica: 0, stage: {s}, tp_rank: {t}, site: {SITES[s]}}}"
                          for s in (0, 1) for t in range(devices))
        return f"{{plan: manual, tp: {devices}, pp: 2, microbatches: 8, schedule: 1f1b, placement: [{place}]}}"
    raise SystemExit(f"unknown plan {plan!r}: use dp, pp, dpxpp, tpxpp or auto")


def cluster_up(geotrain, topology):
    return ClusterUp(geotrain, topology, prefix="geotrain_fabric_", up_args=["--timed-compute"])


def run_one(c, work, topo, model, plan, args, data, flags):
    """One plan on the cluster: its measured figures and the calibrated planner's prediction. `auto` is the
    calibrated planner's choice (`geotrain plan --job`, as the head plans `plan: auto`), run as a manual plan."""
    spec = os.path.join(work, f"{model}-{plan}-{os.path.basename(topo)}")
    if plan == "auto":
        timed.write_job(spec, f"fabric-{model}-{plan}", model, data, "{plan: auto}", args.steps, args.batch)
        chosen = timed.plan_json(args.geotrain, topo, spec, flags, top=1)["ranked"][0]
        parallel = timed.parallel_of(chosen)
        summary = f"dp {chosen['dp']} x pp {chosen['pp']} x tp {chosen['tp']} on {chosen['subset']}"
    else:
        parallel = parallel_section(plan, args.devices, args.batch)
        summary = ""
    row = {"model": model, "plan": plan, "summary": summary, "spec": spec, "topology": topo}
    row.update(timed.measure_plan(
        c, args.geotrain, topo, flags, spec,
        lambda steps: timed.write_job(spec, f"fabric-{model}-{plan}", model, data, parallel, steps, args.batch),
        args.job_timeout))
    return row


def report(rows, args, out, calibration):
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fields = ["model", "rtt_ms", "plan", "state", "step_s", "compute_s", "comm_wait_s", "wan_mb", "predicted_s",
              "predicted_first_s", "wall_s", "summary", "message"]
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plans = args.plans.split(",")
    lines = [f"EMULATED (timed compute): 2 sites x {args.devices} {args.device}, {args.bandwidth_mbps:g} Mbit/s WAN, "
             f"global batch {args.batch} x 1024 tokens, bf16 on the WAN; step seconds, median of the steps after the "
             "warm-up (the calibrated planner's prediction in brackets). DP / best: DP's step over the best plan that uses "
             "every device (the study's comparison); auto: the planner's choice, which may leave devices out.", "",
             "| model | RTT ms | " + " | ".join(plans) + " | auto's plan | DP / best all-device plan | "
             "WAN MB per step (dp / that plan) |",
             "|---|---|" + "---|" * len(plans) + "---|---|---|"]
    for model in args.models.split(","):
        for rtt in [float(x) for x in args.rtt_ms.split(",")]:
            got = {r["plan"]: r for r in rows if r["model"] == model and r["rtt_ms"] == rtt}
            cells = []
            for p in plans:
                r = got.get(p)
                if not r or r["step_s"] == "":
                    cells.append(r["state"] if r else "-")
                else:
                    cells.append(f"{r['step_s']:.2f}" + (f" [{r['predicted_s']:.2f}]" if r["predicted_s"] != "" else ""))
            done = [r for p, r in got.items() if r["step_s"] != "" and p != "auto"]
            best = min(done, key=lambda r: r["step_s"]) if done else None
            dp = got.get("dp")
            ratio = wan = ""
            if best and dp and dp["step_s"] != "":
                ratio = f"{dp['step_s'] / best['step_s']:.2f}x ({best['plan']})"
                wan = f"{dp['wan_mb']} / {best['wan_mb']}"
            auto = got.get("auto", {}).get("summary", "")
            lines.append(f"| {model} | {rtt:g} | " + " | ".join(cells) + f" | {auto} | {ratio} | {wan} |")
    errors = [abs(r["predicted_s"] - r["step_s"]) / r["step_s"] for r in rows
              if r["step_s"] != "" and r["predicted_s"] != ""]
    if errors:
        lines += ["", f"Calibrated planner vs measured over {len(errors)} runs: median relative error "
                  f"{100 * statistics.median(errors):.1f}%, max {100 * max(errors):.1f}%."]
    rounds = calibration.get("measured_rounds", {})
    lines += ["", "Calibration: " + ", ".join(f"{k} efficiency {v:.3f}" for k, v in calibration["efficiency"].items()) +
              f"; inside a site {calibration['intra_site_gbps']:.2f} Gbit/s for gradients and "
              f"{calibration.get('intra_site_activation_gbps') or calibration['intra_site_gbps']:.2f} for activations" +
              (f", fitted to the median of {len(rounds['dp2'])} profiling rounds (DP2 "
               f"{', '.join(f'{x:.3f}' for x in rounds['dp2'])} s; TP2 {', '.join(f'{x:.3f}' for x in rounds['tp2'])} s)"
               if rounds.get("dp2") else "") +
              (f" (loaded from {calibration['loaded_from']}: nothing profiled in this run)"
               if calibration.get("loaded_from") else "") + "; nothing fitted across sites."]
    lines += ["", "The FABRIC study (GPUs, Alpa): DP / pipeline+shard = 13.75x at 103 ms (1,375 vs 100 minutes)."]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no PNG)")
        return
    models = args.models.split(",")
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for p in plans:
            pts = sorted((r["rtt_ms"], r["step_s"]) for r in rows
                         if r["model"] == model and r["plan"] == p and r["step_s"] != "")
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        ax.set_title(f"{model}, 2 sites x {args.devices} {args.device} (EMULATED)")
        ax.set_xlabel("round trip between the sites (ms)")
        ax.set_ylabel("step time (s, emulated GPUs)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    print(f"wrote {out}.csv, {out}.md, {out}.png")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geotrain", default=os.path.join(ROOT, "build", "bin", "geotrain"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "data", "geo", "fabric"))
    ap.add_argument("--models", default="gpt2-medium,gpt2-large")
    ap.add_argument("--rtt-ms", default="0,10,30,103")
    ap.add_argument("--plans", default="dp,pp,dpxpp,tpxpp,auto")
    ap.add_argument("--device", default="A40")
    ap.add_argument("--devices", type=int, default=2, help="devices per site")
    ap.add_argument("--bandwidth-mbps", type=float, default=1000)
    ap.add_argument("--steps", type=int, default=3, help="steps of the calibration's jobs, at least")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--job-timeout", type=float, default=1200)
    ap.add_argument("--calibration", help="a calibration JSON this script wrote (skips profiling)")
    args = ap.parse_args()

    loaded = timed.load_calibration(args.calibration) if args.calibration else None
    work = tempfile.mkdtemp(prefix="geotrain_fabric_")
    try:
        study(args, work, loaded)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def study(args, work, calibration):
    """Calibrates (unless given a calibration), runs every plan at every round trip and writes the report."""
    data = write_tiny_corpus(os.path.join(work, "data"), vocab=50000, length=4096, repeats=20)
    started = time.monotonic()

    def say(text):
        print(f"[{time.monotonic() - started:6.0f} s] {text}", flush=True)
    base, rounds = calibration, []
    if base is None:  # the efficiency only: the bandwidths inside a site are fitted on the round trips' clusters
        base = timed.calibrate(args.geotrain, None, work, data, args.models.split(",")[0], [args.device],
                               args.device, args.steps, args.job_timeout, inside_site=False)
    say(f"calibration: {json.dumps(base)}")
    rows = []
    for rtt in [float(x) for x in args.rtt_ms.split(",")]:
        topo = os.path.join(work, f"topology-{rtt:g}.yaml")
        timed.write_topology(topo, [(s, [(args.device, args.devices)]) for s in SITES],
                             [(SITES[0], SITES[1], rtt / 2, args.bandwidth_mbps)])
        c = cluster_up(args.geotrain, topo)
        try:
            cal = base
            if calibration is None:
                cal = refit(args, c, topo, work, data, base, rounds, say)
            flags = timed.planner_flags(cal)
            for model in args.models.split(","):
                for plan in args.plans.split(","):
                    row = run_one(c, work, topo, model, plan, args, data, flags)
                    row["rtt_ms"] = rtt
                    rows.append(row)
                    print(f"EMULATED [{time.monotonic() - started:6.0f} s] " +
                          json.dumps({k: v for k, v in row.items() if k not in ("spec", "topology")}), flush=True)
        finally:
            c.close()
    if calibration is None:
        final = cal  # the last round trip's fit is to the median of every round
        say(f"fitted on all {len(rounds)} rounds: {final['intra_site_gbps']:.2f} Gbit/s for gradients, "
            f"{final['intra_site_activation_gbps']:.2f} for activations (predicts every plan)")
        repredict(args, rows, timed.planner_flags(final))
        with open(args.out + "-calibration.json", "w") as f:
            json.dump(final, f, indent=1)
    else:
        final = dict(calibration, loaded_from=args.calibration)
    report(rows, args, args.out, final)


def refit(args, c, topo, work, data, base, rounds, say):
    """One round of the profiling jobs inside utah on this round trip's cluster, added to `rounds`
    (timed.add_profiling_round); returns the calibration fitted to the median of the rounds so far."""
    timed.add_profiling_round(rounds, c, topo, SITES[0], work, data, args.models.split(",")[0], args.steps,
                              args.job_timeout, say)
    cal = timed.refit_inside_site(args.geotrain, topo, base, rounds)
    say(f"fitted on {len(rounds)} round(s): {cal['intra_site_gbps']:.2f} Gbit/s for gradients, "
        f"{cal['intra_site_activation_gbps']:.2f} for activations")
    return cal


def repredict(args, rows, flags):
    """Every plan's prediction again with the final fit; the first one is kept in predicted_first_s."""
    for row in rows:
        row["predicted_first_s"] = row["predicted_s"]
        if row["predicted_s"] == "":
            continue
        try:
            row["predicted_s"] = round(timed.predict(args.geotrain, row["topology"], row["spec"], flags), 4)
        except RuntimeError as e:  # kept with the first prediction, and said
            row["message"] = (row["message"] + f" final fit cannot predict it: {e}")[:300]


if __name__ == "__main__":
    main()
