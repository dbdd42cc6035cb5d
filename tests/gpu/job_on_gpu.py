#!/usr/bin/env python3
"""A real training job on this machine's GPUs, end to end: a head and one worker (its CUDA devices
discovered, not emulated) run a small GPT-2 job whose stage actors train on the GPU, and the losses are
compared with the same job trained by `geotrain train --local` on the CPU. With two GPUs or more it also
runs TP=2 (the tensor-parallel all-reduces over NCCL, the unique id handed out by the head's rendezvous)
and DP=2 (the gradient buckets on the GPU, all-reduced over NCCL inside the site); the worker's log must
say that each group used NCCL.

Usage (tests/gpu/run.sh calls it): PYTHONPATH=tests/lib python3 tests/gpu/job_on_gpu.py BUILD_DIR/bin/geotrain
Exits 0 when every job succeeded on the GPU and its losses follow the CPU's; prints one line per job.
"""
import os
import re
import subprocess
import sys

from geotrain_testing.clusters import LocalCluster, wait_for
from geotrain_testing.shards import write_pattern_shard

STEPS = 30
# The GPU's GEMMs against the CPU's train --local in the same precision: the final loss within 3% (the model tests
# bound the per-step difference more tightly; this checks the distributed path end to end).
TOLERANCE = 0.03


def spec(name, data, parallel, train_extra=""):
    return (f"name: {name}\nmodel: {{preset: gpt2-tiny-test}}\ndata: {{train: '{data}'}}\n"
            f"train: {{global_batch: 8, seq_len: 32, steps: {STEPS}, lr: 1.0e-3, warmup_steps: 2, seed: 3"
            f"{train_extra}}}\nparallel: {parallel}\ncomm: {{wan_codec: none}}\n")


def compute_capability():
    """Device 0's compute capability as major * 10 + minor (0 when nvidia-smi cannot say)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.split()
    try:
        major, minor = out[0].split(".")
        return int(major) * 10 + int(minor)
    except (IndexError, ValueError):
        return 0


def losses_of(text, pattern):
    return [float(m.group(1)) for m in re.finditer(pattern, text)]


def main():
    geotrain = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build-gpu/bin/geotrain")
    gpus = int(subprocess.run(["bash", "-c", "nvidia-smi -L | grep -c '^GPU'"], capture_output=True,
                              text=True).stdout.strip() or 0)
    if gpus == 0:
        print("no GPU on this machine: nothing to run")
        return 1
    c = LocalCluster(geotrain)
    failed = 0
    try:
        data = os.path.join(c.dir, "train_000000.bin")
        write_pattern_shard(data, 100000, 512)
        # The CPU's train --local of the same job, in the same precision (the CPU emulates bf16 and fp16 by rounding
        # the GEMMs' inputs as the tensor cores take them): the reference each GPU job must follow.
        references = {}

        def reference(train_extra):
            if train_extra not in references:
                path = os.path.join(c.dir, f"local-{len(references)}.yaml")
                with open(path, "w") as f:
                    f.write(spec("local", data, "{plan: manual}", train_extra))
                out = subprocess.run([geotrain, "train", "--local", path], capture_output=True, text=True,
                                     timeout=300, env=c.env)
                losses = losses_of(out.stdout, r"step \d+/\d+ \| loss ([0-9.]+)")
                skipped = out.stdout.count("(overflow: skipped)")
                if out.returncode != 0 or len(losses) != STEPS:
                    raise RuntimeError(f"train --local failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
                references[train_extra] = (losses, skipped)
            return references[train_extra]
        c.start_head()
        c.start_worker("gpu0", "gpu-site")
        wait_for(lambda: list(c.worker_states().values()).count("WORKER_ALIVE") == 1, 60, "the GPU worker")
        # (name, parallel section, what the actors' log lines must say about NCCL)
        # and how many actors the job has.
        # precision auto (bf16 from compute capability 8.0, fp16 before), then each precision forced in turn, and fp16
        # from a loss scale of 2^40: its first steps overflow on the GPU and are skipped, as the CPU's are.
        jobs = [("gpu-single", "{plan: manual}", None, 1, "")]
        jobs += [("gpu-fp32", "{plan: manual}", None, 1, ", precision: fp32"),
                 ("gpu-fp16", "{plan: manual}", None, 1, ", precision: fp16"),
                 ("gpu-fp16-overflow", "{plan: manual}", None, 1,
                  ", precision: fp16, loss_scale: {initial: 1099511627776}")]
        if compute_capability() >= 80:
            jobs.append(("gpu-bf16", "{plan: manual}", None, 1, ", precision: bf16"))
        if gpus >= 2:
            jobs += [("gpu-tp2", "{plan: manual, tp: 2}", "tensor-parallel all-reduces on NCCL", 2, ""),
                     ("gpu-dp2", "{plan: manual, dp: 2}", "on NCCL inside the site", 2, "")]
        for name, parallel, nccl_line, actors, train_extra in jobs:
            # auto on a GPU resolves to bf16 (8.0 and newer) or fp16: the CPU reference runs the same.
            resolved = train_extra or (", precision: bf16" if compute_capability() >= 80 else ", precision: fp16")
            try:
                cpu, cpu_skipped = reference(resolved)
            except RuntimeError as e:
                print(f"{name}: FAIL {e}")
                failed = 1
                continue
            lines_before = c.logs().count(nccl_line) if nccl_line else 0
            path = os.path.join(c.dir, f"{name}.yaml")
            with open(path, "w") as f:
                f.write(spec(name, data, parallel, train_extra))
            try:
                r = c.cli(["job", "submit", path, "--follow"], check=False, timeout=90)
            except subprocess.TimeoutExpired:
                print(f"{name}: FAIL (not finished within 90 s; a job that cannot be placed stays PENDING)\n"
                      + c.cli(["status"], check=False).stdout + c.logs()[-6000:])
                failed = 1
                continue
            gpu = losses_of(r.stdout, r"step \d+ loss ([0-9.]+)")
            ok = r.returncode == 0 and "SUCCEEDED" in r.stdout and len(gpu) == STEPS
            logs = c.logs()
            on_gpu = "on cuda:" in logs
            # Every actor of the job logs the line once (the logs are read after the job: it ran alone).
            on_nccl = nccl_line is None or logs.count(nccl_line) - lines_before >= actors
            diff = abs(gpu[-1] - cpu[-1]) / cpu[-1] if ok else float("nan")
            status = c.cli(["job", "status", r.stdout.split()[1] if ok else "", "--json"], check=False).stdout \
                if ok else ""
            skipped = int(re.search(r'"skipped_?[sS]teps": "?(\d+)', status).group(1)) \
                if re.search(r'"skipped_?[sS]teps": "?(\d+)', status) else 0
            precision = (re.search(r'"precision": "(\w+)"', status) or [None, "?"])[1] if status else "?"
            # The GPU skips the steps the CPU's emulation skips (fp16 overflows the same way).
            good = ok and on_gpu and on_nccl and diff <= TOLERANCE and gpu[-1] < gpu[0] and skipped == cpu_skipped
            print(f"{name}: {'PASS' if good else 'FAIL'} precision {precision}, final loss "
                  f"{gpu[-1] if gpu else 'n/a'} vs CPU {cpu[-1]:.4f} (relative {diff:.4f}, bound {TOLERANCE}); "
                  f"first {gpu[0] if gpu else 'n/a'}; skipped steps {skipped} (CPU {cpu_skipped}); "
                  f"stage on the GPU: {on_gpu}; NCCL as expected: {on_nccl}")
            if not good:
                failed = 1
                print(r.stdout[-3000:] + r.stderr[-2000:] + logs[-6000:])
    finally:
        c.close()
    return failed


if __name__ == "__main__":
    sys.exit(main())
