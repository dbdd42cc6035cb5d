"""Chaos benchmark (issue 13): the demo job for a fixed wall time on two `cluster up` clusters side by side,
one under a schedule of faults, one without; per fault kind the detection and recovery times, the steps lost,
and the goodput (useful steps per hour against the fault-free run).

Both clusters run at the same time on this machine, so both see the same CPU contention; while the faulty one
recovers, the fault-free one gets more of the CPU, which makes the goodput ratio conservative.

The faults, one every --fault-every seconds (the first half an interval in), cycle through:
  worker   kill -9 of a worker that hosts an actor (restarted 30 s later, as systemd would: a spare again)
  outage   the emulated WAN link between the sites down for 2 s, then 20 s
  head     kill -9 of the head, restarted 2 s later on the same state dir
  corrupt  the newest checkpoint's model file truncated, then a worker kill: the restart must skip it
The job checkpoints every 5 steps (in the background); a restart loses the steps since the last one.
Not part of `make test` (it runs for --minutes). Usage:
  /usr/bin/python3 bench/chaos/chaos.py [--minutes 30] [--fault-every 300] [--out build/chaos]
From the checkout, with PYTHONPATH=tests/lib (the shared code: geotrain_testing).
Writes OUT/chaos.json (every sample and fault) and OUT/chaos.md (the tables for docs/reliability.md).
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

from geotrain_testing.clusters import ClusterUp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

KINDS = ["worker", "outage", "worker", "head", "outage", "corrupt"]
OUTAGES = [2, 20]


def job_spec(name, data, ckpt):
    return f"""name: {name}
model: {{preset: gpt2-demo}}
data: {{train: '{data}/train_*.bin'}}
train: {{global_batch: 16, seq_len: 64, steps: 1000000, lr: 2.0e-3, warmup_steps: 5, weight_decay: 0.1,
         grad_clip: 1.0, seed: 1}}
parallel:
  plan: manual
  dp: 2
  pp: 2
  microbatches: 2
  schedule: 1f1b
  placement:
    - {{replica: 0, stage: 0, site: site-a}}
    - {{replica: 1, stage: 0, site: site-a}}
    - {{replica: 0, stage: 1, site: site-b}}
    - {{replica: 1, stage: 1, site: site-b}}
comm: {{wan_codec: bf16}}
checkpoint: {{dir: '{ckpt}', every_steps: 5, keep: 3, resume: auto}}
fault_tolerance: {{max_restarts: -1, wait_for_workers_s: 120}}
"""


class Run:
    """One cluster, its job, and a sampler thread that records (time, step, attempt, state) every 0.5 s."""

    def __init__(self, geotrain, topology, name, data, out):
        self.name = name
        self.c = ClusterUp(geotrain, topology, f"geotrain_chaos_{name}_")
        self.ckpt = os.path.join(out, f"ckpt-{name}")
        spec = os.path.join(out, f"{name}.yaml")
        with open(spec, "w") as f:
            f.write(job_spec(f"chaos-{name}", data, self.ckpt))
        self.job_id = self.c.cli(["job", "submit", spec]).stdout.split()[1]
        self.samples = []  # (unix seconds, step, attempt, state)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def status(self):
        r = self.c.cli(["job", "status", self.job_id, "--json"], check=False, timeout=20)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def sample(self):
        while not self.stop.is_set():
            try:
                j = self.status()
            except (subprocess.TimeoutExpired, json.JSONDecodeError):
                j = None
            if j is not None:
                self.samples.append((time.time(), int(j["step"]), int(j["attempt"]), j["state"]))
            self.stop.wait(0.5)

    def step(self):
        return self.samples[-1][1] if self.samples else 0

    def first_progress_after(self, since, step_at):
        """The first sample after `since` whose step is beyond `step_at` (training again), or None."""
        for t, step, _, _ in self.samples:
            if t > since and step > step_at:
                return t
        return None

    def close(self):
        self.stop.set()
        self.thread.join()
        self.c.cli(["job", "cancel", self.job_id], check=False)
        self.c.close()


def actor_worker(run, index):
    """A worker that hosts one of the job's actors (a different one for each fault index)."""
    j = run.status()
    workers = sorted({a["worker_id"] for a in (j or {}).get("actors", []) if a.get("worker_id")})
    if not workers:
        raise RuntimeError(f"job {run.job_id} has no actors to kill a worker of")
    return workers[index % len(workers)]


def inject(run, kind, outage_s, index, log):
    """Injects one fault; returns (inject time, fault-end time, details)."""
    c = run.c
    if kind in ("worker", "corrupt"):
        detail = {}
        if kind == "corrupt":
            latest = os.path.join(run.ckpt, open(os.path.join(run.ckpt, "latest")).read().strip())
            victim_file = sorted(f for f in os.listdir(latest) if f.startswith("model"))[0]
            with open(os.path.join(latest, victim_file), "r+b") as f:
                f.truncate(100)
            detail["corrupted"] = os.path.basename(latest)
        victim = actor_worker(run, index)
        t = time.time()
        c.kill(f"worker {victim}")
        log(f"killed worker {victim} at step {run.step()}")
        threading.Timer(30, lambda: c.restart(f"worker {victim}")).start()
        detail["victim"] = victim
        return t, t, detail
    if kind == "outage":
        t = time.time()
        c.netem("link down site-a site-b")
        time.sleep(outage_s)
        c.netem("link up site-a site-b")
        log(f"link down for {outage_s} s at step {run.step()}")
        return t, time.time(), {"seconds": outage_s}
    if kind == "head":
        t = time.time()
        c.kill("head")
        time.sleep(2)
        c.restart("head")
        log(f"head killed and restarted at step {run.step()}")
        return t, time.time(), {}
    raise ValueError(kind)


def summarize(values):
    return {"median": statistics.median(values), "max": max(values), "n": len(values)} if values else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--fault-every", type=float, default=300, help="seconds between faults")
    ap.add_argument("--geotrain", default=os.path.join(ROOT, "build", "bin", "geotrain"))
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "chaos"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    started = time.time()

    def log(msg):
        print(f"[{time.time() - started:7.1f} s] {msg}", flush=True)

    data = os.path.join(ROOT, "build", "demo", "data")
    if not os.path.exists(os.path.join(data, "train_000000.bin")):
        log("tokenizing the fortunes corpus")
        subprocess.run([args.geotrain, "data", "prepare", "/usr/share/games/fortunes", "--out", data,
                        "--val-fraction", "0.01"], check=True, stdout=subprocess.DEVNULL)
    topology = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two-sites-spares.yaml")
    runs = {}
    try:
        for name in ("faulty", "baseline"):
            runs[name] = Run(args.geotrain, topology, name, data, args.out)
        faulty, baseline = runs["faulty"], runs["baseline"]
        log(f"two clusters up; jobs {faulty.job_id} (faults) and {baseline.job_id} (no faults) submitted")
        t0 = time.time()
        end = t0 + args.minutes * 60
        faults = []
        next_fault = t0 + args.fault_every / 2
        outages = 0
        while time.time() < end:
            if next_fault > end - 30:
                next_fault = float("inf")  # no fault in the last 30 s: its recovery could not be seen
            time.sleep(min(10, max(0.1, min(next_fault, end) - time.time())))
            if time.time() >= next_fault:
                kind = KINDS[len(faults) % len(KINDS)]
                outage_s = OUTAGES[outages % len(OUTAGES)] if kind == "outage" else 0
                outages += kind == "outage"
                step_at = faulty.step()
                restarts_before = len((faulty.status() or {}).get("faults", []))
                t, t_end, detail = inject(faulty, kind, outage_s, len(faults), log)
                faults.append({"kind": kind, "inject": t, "end": t_end, "step_at": step_at,
                               "restarts_before": restarts_before, **detail})
                next_fault += args.fault_every
            log(f"faulty step {faulty.step()} | fault-free step {baseline.step()}")
        final = {name: r.step() for name, r in runs.items()}
        elapsed = time.time() - t0
        log(f"done after {elapsed:.0f} s: faulty {final['faulty']} steps, fault-free {final['baseline']} steps")

        # Per fault: the head's FaultRecord (detection, steps lost) where the fault restarted the job, and
        # training again = the first sample whose step is beyond the step at the fault, after the fault ended.
        records = (faulty.status() or {}).get("faults", [])
        for i, f in enumerate(faults):
            f["restarted"] = False
            until = faults[i + 1]["inject"] if i + 1 < len(faults) else float("inf")
            for r in records:
                detected = int(r["detected_unix_ms"]) / 1000  # a record belongs to the last fault before it
                if f["inject"] <= detected < until:
                    # Training again: detected, then the head's own measure from detection to the first step
                    # the restarted run completes.
                    f.update(restarted=True, detected_s=detected - f["inject"], steps_lost=int(r["steps_lost"]),
                             resumed_from=os.path.basename(r["resumed_from"]), cause=r["cause"],
                             training_again_s=detected - f["inject"] + float(r["recovery_seconds"]))
                    break
            if not f["restarted"]:
                # No restart: training again is the first sample with a step beyond the one at the fault's end.
                f["steps_lost"] = 0
                step_at_end = max([s for t, s, _, _ in faulty.samples if t <= f["end"]] or [0])
                again = faulty.first_progress_after(f["end"], step_at_end)
                f["training_again_s"] = (again - f["end"]) if again else None
        for name, r in runs.items():  # the job logs: step events (with checkpoint costs) and fault events
            with open(os.path.join(args.out, f"{name}-job.log"), "w") as f:
                f.write(r.c.cli(["job", "logs", r.job_id], check=False).stdout)
        result = {
            "minutes": args.minutes, "fault_every_s": args.fault_every, "elapsed_s": elapsed,
            "steps": final, "goodput": final["faulty"] / final["baseline"] if final["baseline"] else None,
            "faults": faults,
            "samples": {name: r.samples for name, r in runs.items()},
        }
        with open(os.path.join(args.out, "chaos.json"), "w") as f:
            json.dump(result, f, indent=1)
        result["checkpoint_cost"] = checkpoint_cost(os.path.join(args.out, "baseline-job.log"))
        write_table(result, os.path.join(args.out, "chaos.md"))
        print(open(os.path.join(args.out, "chaos.md")).read())
    finally:
        for r in runs.values():
            r.close()


def checkpoint_cost(job_log):
    """From a job's step events: the training thread's checkpoint snapshot time, and the step times of
    steps with and without a checkpoint (medians)."""
    import re
    snap, with_ckpt, without = [], [], []
    for line in open(job_log):
        m = re.search(r" step \d+ loss .* step ([0-9.]+) s \((.*)\) wan", line)
        if not m:
            continue
        c = re.search(r"checkpoint ([0-9.]+)", m.group(2))
        (with_ckpt if c else without).append(float(m.group(1)))
        if c:
            snap.append(float(c.group(1)))
    if not snap or not without:
        return None
    return {"snapshot_s": statistics.median(snap), "step_with_s": statistics.median(with_ckpt),
            "step_without_s": statistics.median(without), "checkpoints": len(snap)}


def write_table(result, path):
    lines = ["| fault | n | detected (median / max) | training again after the fault ended (median / max) | "
             "steps lost (median / max) | restarts |", "|---|---|---|---|---|---|"]
    names = {"worker": "worker kill -9", "outage": "WAN link down", "head": "head kill -9 (back after 2 s)",
             "corrupt": "corrupted newest checkpoint + worker kill"}
    for kind in ("worker", "corrupt", "outage", "head"):
        fs = [f for f in result["faults"] if f["kind"] == kind]
        if not fs:
            continue
        label = names[kind]
        if kind == "outage":
            label += " (" + ", ".join(f"{f['seconds']} s" for f in fs) + ")"

        def cell(key, unit=" s", fmt="{:.1f}"):
            s = summarize([f[key] for f in fs if f.get(key) is not None])
            return f"{fmt.format(s['median'])} / {fmt.format(s['max'])}{unit}" if s else "-"
        lines.append(f"| {label} | {len(fs)} | {cell('detected_s')} | {cell('training_again_s')} | "
                     f"{cell('steps_lost', '', '{:.0f}')} | {sum(f['restarted'] for f in fs)} |")
    g = result["goodput"]
    lines.append("")
    lines.append(f"Goodput: {result['steps']['faulty']} useful steps under faults against {result['steps']['baseline']} "
                 f"without, in the same {result['elapsed_s'] / 60:.1f} minutes: {100 * g:.0f}% "
                 f"({len(result['faults'])} faults, one every {result['fault_every_s'] / 60:.0f} minutes).")
    c = result.get("checkpoint_cost")
    if c:
        lines.append("")
        lines.append(f"Checkpoint cost on the training thread (fault-free run, {c['checkpoints']} checkpoints): "
                     f"snapshot {c['snapshot_s']:.3f} s median; median step {c['step_with_s']:.2f} s with a "
                     f"checkpoint, {c['step_without_s']:.2f} s without (the files are written in the background).")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    main()
