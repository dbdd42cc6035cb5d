"""What a live regroup and a heal cost, on the chaos benchmark's cluster and demo job: the healthy replicas' pause
between two complete steps around (1) kill -9 of a worker that hosts an actor of one replica, and (2) `geotrain worker
drain` of a worker that hosts an actor of one replica (a leave by regroup), each against the job's median step time
before it (docs/reliability.md: the goal is a pause of at most two median steps); and after the kill, the heal of the
lost replica onto the spares: its cost (the fault's detection to the healed replica's first step; goal: within 10 s)
and the healthy replica's pause while it joins.

One `cluster up bench/chaos/two-sites-spares.yaml` (two sites 30 ms apart, three emulated RTX 6000 workers each), the
demo job of bench/chaos/chaos.py (gpt2-demo, DP2 x PP2 across the sites, bf16 on the WAN). Each case runs its own job
to step --warm-steps, then the fault; the pause, the detection and the steps are read from the job's log.
Not part of `make test`. Usage, from the checkout:
  PYTHONPATH=tests/lib /usr/bin/python3 bench/chaos/regroup_pause.py [--warm-steps 10] [--out build/regroup-pause]
Writes OUT/regroup_pause.json and prints one line per case.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos import ROOT, job_spec  # noqa: E402  (the chaos benchmark's job)
from geotrain_testing.clusters import ClusterUp, wait_for  # noqa: E402

SENT_LINE = re.compile(r"sent its stage's state \((\d+) bytes\) to replicas \[[\d, ]*\] in ([\d.e-]+) s")
STEP_LINE = re.compile(r"^(\S+ \S+) step (\d+) loss \S+ \S+ tokens/s step ([\d.]+) s", re.M)


def log_time(stamp):
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))


def run_case(c, kind, data, out, warm_steps, index):
    ckpt = os.path.join(out, f"ckpt-{kind}")
    shutil.rmtree(ckpt, ignore_errors=True)  # the job resumes from its checkpoint dir (resume: auto): start afresh
    spec = os.path.join(out, f"{kind}.yaml")
    with open(spec, "w") as f:
        f.write(job_spec(f"regroup-{kind}", data, ckpt))
    job_id = c.cli(["job", "submit", spec]).stdout.split()[1]
    c.wait_log(job_id, rf"step {warm_steps} loss", timeout=900)
    logs = c.logs(job_id)
    before = [float(s) for _, _, s in STEP_LINE.findall(logs)][2:]  # the first steps warm up
    actors = c.job(job_id)["actors"]
    victim = next(a["worker_id"] for a in actors if a["worker_id"].startswith("site-b"))
    t = time.time()
    if kind == "kill":
        c.kill(f"worker {victim}")
    else:
        c.cli(["worker", "drain", victim])
    m = c.wait_log(job_id, r"paused ([\d.]+) s between two complete steps|RESTARTING: .*", timeout=300)
    if m.group(1) is None:
        raise RuntimeError(f"{kind}: the job restarted instead of regrouping: {m.group(0)}")
    pause = float(m.group(1))
    heal = {}
    if kind == "kill":  # the lost replica comes back on the spares, its state streamed from the live one
        h = c.wait_log(job_id, r"healed replicas trained their first step \((\d+)\): ([\d.]+) s after|RESTARTING: .*",
                       timeout=300)
        if h.group(1) is None:
            raise RuntimeError(f"heal: the job restarted instead: {h.group(0)}")
        after = c.logs(job_id).split("healed: ", 1)[1]
        joined = re.search(r"stayed healthy paused ([\d.]+) s", after)
        # Each donor actor's transfer, from the workers' logs: bytes and seconds.
        sent = []
        logs_dir = os.path.join(c.state, "logs")
        for name in sorted(os.listdir(logs_dir)):
            with open(os.path.join(logs_dir, name), errors="replace") as f:
                sent += [(int(b), float(s)) for b, s in SENT_LINE.findall(f.read())]
        heal = {"heal_s": float(h.group(2)), "healed_first_step": int(h.group(1)),
                "heal_pause_s": float(joined.group(1)) if joined else None,
                "state_sent": [{"bytes": b, "seconds": s} for b, s in sent]}
    logs = c.logs(job_id)
    job = c.job(job_id)
    c.cli(["job", "cancel", job_id], check=False)
    if kind == "kill":
        c.restart(f"worker {victim}")
    median = statistics.median(before)
    case = {"case": kind, "job": job_id, "victim": victim, "median_step_s": median, "pause_s": pause,
            "pause_in_median_steps": pause / median, "restarts": int(job.get("restarts", 0)),
            "regroups": int(job.get("regroups", 0)), "replicas": job.get("replicas"),
            "fault_line": next((l for l in logs.splitlines() if "without a restart" in l), ""),
            "heals": int(job.get("heals", 0)), **heal, "seconds_from_fault_to_log_end": time.time() - t}
    print(f"{kind}: healthy pause {pause:.1f} s = {pause / median:.2f} median steps ({median:.2f} s); "
          f"restarts {case['restarts']}, regroups {case['regroups']}, replicas {case['replicas']}", flush=True)
    if heal:
        print(f"heal: the lost replica trained again {heal['heal_s']:.1f} s after the fault's detection (step "
              f"{heal['healed_first_step']}); the healthy replica paused {heal['heal_pause_s']:.1f} s = "
              f"{heal['heal_pause_s'] / median:.2f} median steps while it joined; state sent: " +
              ", ".join(f"{x['bytes'] / 1e6:.1f} MB in {x['seconds']:.2f} s" for x in heal["state_sent"]), flush=True)
    # The next case's job gets every worker back.
    wait_for(lambda: all(w["state"] == "WORKER_ALIVE" and not w.get("draining") for w in json.loads(
        c.cli(["status", "--json"]).stdout)["workers"] if w["worker_id"] != victim or kind == "kill"), 60,
             "the workers alive again", 0.5)
    return case


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-steps", type=int, default=10)
    ap.add_argument("--geotrain", default=os.path.join(ROOT, "build", "bin", "geotrain"))
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "regroup-pause"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(ROOT, "build", "demo", "data")
    if not os.path.exists(os.path.join(data, "train_000000.bin")):
        subprocess.run([args.geotrain, "data", "prepare", "/usr/share/games/fortunes", "--out", data,
                        "--val-fraction", "0.01"], check=True, stdout=subprocess.DEVNULL)
    topology = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two-sites-spares.yaml")
    c = ClusterUp(args.geotrain, topology, "geotrain_regroup_pause_")
    try:
        cases = [run_case(c, kind, data, args.out, args.warm_steps, i) for i, kind in enumerate(("kill", "drain"))]
    finally:
        c.close()
    with open(os.path.join(args.out, "regroup_pause.json"), "w") as f:
        json.dump(cases, f, indent=1)


if __name__ == "__main__":
    main()
