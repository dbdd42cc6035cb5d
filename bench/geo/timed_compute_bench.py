#!/usr/bin/env python3
"""EMULATED: GPT-2 medium DP2 across two sites on timed compute (docs/timed-compute.md).

`geotrain cluster up --timed-compute` of two sites with one emulated GPU each (default H100), linked at each
--latency-ms (one way) and --bandwidth-mbps, and a synchronous DP2 job of GPT-2 medium (global batch --batch
sequences of 1024 tokens, bf16 gradients across sites) for --steps steps. Prints, per latency, the median step
time after the first step, its compute (the emulated GPU's waits), comm wait and WAN bytes per step (both
directions). Every figure is EMULATED: the GPUs'
compute is waited, not run; the communication (gRPC, codecs, the WAN emulator) really runs on this machine's cores.

Usage: /usr/bin/python3 bench/geo/timed_compute_bench.py [--geotrain build/bin/geotrain] [--device H100]
           [--latency-ms 0.5,30] [--bandwidth-mbps 10000] [--steps 4] [--batch 16]
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "control"))
from cluster_lib import ClusterUp, write_tiny_corpus  # noqa: E402

STEP_LINE = re.compile(r"step (\d+) EMULATED \(timed compute\) loss n/a \d+ tokens/s step ([\d.]+) s "
                       r"\(compute ([\d.]+), comm wait ([\d.]+), bubble ([\d.]+)[^)]*\) wan bytes (\d+)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geotrain", default=os.path.join(ROOT, "build", "bin", "geotrain"))
    ap.add_argument("--device", default="H100")
    ap.add_argument("--latency-ms", default="0.5,30")
    ap.add_argument("--bandwidth-mbps", type=float, default=10000)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="geotrain_timed_bench_")
    data = write_tiny_corpus(os.path.join(work, "data"), vocab=50000, length=4096, repeats=20)
    rows = []
    for latency in [float(x) for x in args.latency_ms.split(",")]:
        topology = os.path.join(work, f"topology-{latency}.yaml")
        with open(topology, "w") as f:
            f.write(f"sites:\n  - {{name: a, workers: [{{device: {args.device}, count: 1}}]}}\n"
                    f"  - {{name: b, workers: [{{device: {args.device}, count: 1}}]}}\n"
                    f"links:\n  - {{a: a, b: b, latency_ms: {latency}, bandwidth_mbps: {args.bandwidth_mbps}, "
                    "jitter_ms: 0}\n")
        spec = os.path.join(work, "dp2.yaml")
        with open(spec, "w") as f:
            f.write(f"name: timed-medium-dp2\nmodel: {{preset: gpt2-medium}}\ndata: {{train: '{data}'}}\n"
                    f"train: {{steps: {args.steps}, global_batch: {args.batch}, seq_len: 1024}}\n"
                    "parallel: {plan: manual, dp: 2, microbatches: 1}\ncomm: {wan_codec: bf16}\n")
        c = ClusterUp(args.geotrain, topology, prefix="geotrain_timed_bench_", up_args=["--timed-compute"])
        try:
            job_id = c.cli(["job", "submit", spec]).stdout.split()[1]
            job = c.wait_job(job_id, 900)
            log = c.logs(job_id)
            if job["state"] != "JOB_SUCCEEDED":
                print(log + c.process_logs())
                sys.exit(f"the job ended {job['state']}")
            steps = [m for m in STEP_LINE.finditer(log) if int(m.group(1)) > 1]
            row = {
                "latency_ms": latency,
                "step_s": statistics.median(float(m.group(2)) for m in steps),
                "compute_s": statistics.median(float(m.group(3)) for m in steps),
                "comm_wait_s": statistics.median(float(m.group(4)) for m in steps),
                "wan_bytes": int(statistics.median(int(m.group(6)) for m in steps)),
            }
            rows.append(row)
            print("EMULATED " + json.dumps(row), flush=True)
        finally:
            c.close()

    print(f"\nEMULATED: GPT-2 medium DP2, 2 sites x 1 {args.device} (timed compute), global batch {args.batch} x 1024, "
          f"{args.bandwidth_mbps:.0f} Mbit/s, medians of steps 2..{args.steps}")
    print(f"{'one-way ms':>10} {'step s':>8} {'compute s':>10} {'comm wait s':>12} {'WAN MB/step':>12}")
    for r in rows:
        print(f"{r['latency_ms']:>10.1f} {r['step_s']:>8.3f} {r['compute_s']:>10.3f} {r['comm_wait_s']:>12.3f} "
              f"{r['wan_bytes'] / 1e6:>12.1f}")


if __name__ == "__main__":
    main()
