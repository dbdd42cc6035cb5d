#!/usr/bin/env python3
"""Gradient all-reduce overlapped with backward vs after backward, measured on an emulated WAN.

Brings up two sites of one worker each with `geotrain cluster up` (the WAN emulator between them) and
trains the same DP=2 job (one replica per site, so the gradient all-reduce crosses the WAN) with
comm.grad_bucket_mb = 1e6 (one bucket: the all-reduce starts after backward) and with small buckets
(each starts as soon as backward has finished its layers). Runs the two alternately, --repeats times,
and prints the median step time (steps after the first) and the communication wait of each.

Usage: /usr/bin/python3 bench/comm/grad_overlap.py [--geotrain build/bin/geotrain] [--latency-ms 30]
                                                   [--bandwidth-mbps 300] [--steps 6] [--repeats 2]
From the checkout, with PYTHONPATH=tests/lib (the shared code: geotrain_testing).
"""
import argparse
import os
import shutil
import statistics

from geotrain_testing.clusters import private_cluster_env, run
from geotrain_testing.logs import cluster_steps
from geotrain_testing.shards import write_pattern_shard

# 8 blocks of 256 channels: 3.1 MB of gradients per block, 25 MB per step, so that the all-reduce is
# comparable with the backward pass on a CPU worker.
MODEL = "{n_layer: 8, n_head: 4, n_embd: 256, block_size: 64, vocab_size: 512}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geotrain", default="build/bin/geotrain")
    ap.add_argument("--latency-ms", type=float, default=30)
    ap.add_argument("--bandwidth-mbps", type=float, default=300)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--small-bucket-mb", type=float, default=4)
    args = ap.parse_args()
    geotrain = os.path.abspath(args.geotrain)
    work, env = private_cluster_env("geotrain_overlap_")
    data = os.path.join(work, "train_000000.bin")
    write_pattern_shard(data, 200000, 512)
    topo = os.path.join(work, "topo.yaml")
    with open(topo, "w") as f:
        f.write("sites:\n  - {name: a, workers: [{device: RTX6000}]}\n  - {name: b, workers: [{device: RTX6000}]}\n"
                f"links:\n  - {{a: a, b: b, latency_ms: {args.latency_ms}, bandwidth_mbps: {args.bandwidth_mbps}, "
                "jitter_ms: 0}\n")
    configs = [("after-backward", 1e6), ("overlapped", args.small_bucket_mb)]
    results = {name: {"step": [], "wait": []} for name, _ in configs}
    run([geotrain, "cluster", "up", topo], env)
    try:
        for rep in range(args.repeats):
            for name, bucket_mb in configs:
                spec = os.path.join(work, f"{name}-{rep}.yaml")
                with open(spec, "w") as f:
                    f.write(f"name: overlap-{name}-{rep}\nmodel: {MODEL}\ndata: {{train: '{data}'}}\n"
                            f"train: {{global_batch: 16, seq_len: 64, steps: {args.steps}, lr: 1.0e-3, seed: 1}}\n"
                            "parallel: {plan: manual, dp: 2, microbatches: 1, "
                            "placement: [{replica: 0, site: a}, {replica: 1, site: b}]}\n"
                            f"comm: {{wan_codec: none, grad_bucket_mb: {bucket_mb}}}\n")
                out = run([geotrain, "job", "submit", spec, "--follow"], env)
                steps = [(s["step_s"], s["comm_wait_s"]) for s in cluster_steps(out)]
                if len(steps) != args.steps:
                    raise RuntimeError(f"{name}: expected {args.steps} steps:\n{out}")
                for step_s, wait_s in steps[1:]:
                    results[name]["step"].append(step_s)
                    results[name]["wait"].append(wait_s)
                print(f"{name} (bucket {bucket_mb} MB) repeat {rep}: median step "
                      f"{statistics.median(s for s, _ in steps[1:]):.3f} s", flush=True)
    finally:
        run([geotrain, "cluster", "down"], env)
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(results["after-backward"]["step"])
    print(f"\nDP=2 across a {args.latency_ms:g} ms, {args.bandwidth_mbps:g} Mbit/s link, {MODEL}, "
          f"{len(results['after-backward']['step'])} steps each (load {os.getloadavg()[0]:.1f}):")
    print("| gradient all-reduce | median step (s) | median comm wait (s) | vs after backward |")
    print("|---|---|---|---|")
    for name, _ in configs:
        step = statistics.median(results[name]["step"])
        wait = statistics.median(results[name]["wait"])
        print(f"| {name} | {step:.3f} | {wait:.3f} | {base / step:.2f}x |")


if __name__ == "__main__":
    main()
