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
From the checkout, with PYTHONPATH=tests/lib (the shared code: geotrain_testing).
"""
import argparse
import json
import os
import sys
import tempfile

from geotrain_testing import timed
from geotrain_testing.clusters import ClusterUp
from geotrain_testing.shards import write_tiny_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
        timed.write_topology(topology, [("a", [(args.device, 1)]), ("b", [(args.device, 1)])],
                             [("a", "b", latency, args.bandwidth_mbps)])
        spec = os.path.join(work, "dp2.yaml")
        timed.write_job(spec, "timed-medium-dp2", "gpt2-medium", data, "{plan: manual, dp: 2, microbatches: 1}",
                        args.steps, args.batch)
        c = ClusterUp(args.geotrain, topology, prefix="geotrain_timed_bench_", up_args=["--timed-compute"])
        try:
            r = timed.run_job(c, spec, 900)
            if r["state"] != "SUCCEEDED":
                print(r["message"] + "\n" + c.process_logs())
                sys.exit(f"the job ended {r['state']}")
            row = {"latency_ms": latency, "step_s": r["step_s"], "compute_s": r["compute_s"],
                   "comm_wait_s": r["comm_wait_s"], "wan_bytes": r["wan_bytes"]}
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
