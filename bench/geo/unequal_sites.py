#!/usr/bin/env python3
"""DiLoCo across two sites of unequal speed: count-paced outer steps (diloco.sync steps) against time-paced ones
(diloco.sync time), on a real cluster with one site's CPU slowed (worker --slowdown: EMULATED times, real numerics).

`geotrain cluster up` of two sites, a and b, one CPU worker each (--latency-ms one way between them, default 0,
at --bandwidth-mbps), site b started with `--slowdown b=F` (--slowdown, default 2). On it, in turn, --repeats times:

solo-a, solo-b  the job on one site alone (dp 1, the DiLoCo replica's batch: --batch / 2 sequences), for
                --solo-steps steps: each site's tokens/s, the median over steps 2 to N-1 of the head's step lines.
solo-a-together, solo-b-together  the two solo jobs submitted at the same time (site a for as many more steps as
                it was faster alone): each site's rate while the other computes too, as in a DiLoCo job. On this
                machine the sites share two cores (and a slowed site's wait is F-1 times each op's time as
                measured, contention included), so this is the most two sites can do here at once.
count-paced     DiLoCo, dp 2, one replica per site, inner_steps --inner-steps, int8 pseudo-gradients, outer lr 1
                without momentum, for --steps steps: every group takes inner_steps steps between outer steps, so the
                fast site waits for the slow one at each outer step.
time-paced      the same job with `diloco: {sync: time}`: after its first two (count-paced) steps each group takes
                as many inner steps as fit in the time the slowest group takes for the rest of the period, and from
                the first outer step on for each whole period.

Then once, `count-paced-equal-tokens`: the count-paced job run for as many steps as hold the time-paced runs'
tokens (their median; a time-paced step trains more tokens than a count-paced one), so that the final validation
losses compare at equal tokens, each job with its own full learning-rate schedule.

What each DiLoCo run reports, over two windows of its steps (`all`: steps 2 to N-1; `steady`: steps H+1 to N-1,
after the first outer period, which time pacing runs count-paced; step 1 pays the start-up and step N the final
sync and the evaluation):
- wall: the time between the arrivals of the step lines that bound the window, as `job submit --follow` streams
  them (this process's clock). The head's per-step `step` seconds are each the slowest actor's and do not add up
  to the wall time when the sites run apart between outer steps.
- tokens: each step's tokens (tokens/s x step seconds of its line, rounded to whole replica batches: every group's
  inner steps), and tokens/s = tokens / wall, against the sum of the solo rates.
- the fast site's idle share: the sum of the step lines' `outer sync` seconds over the wall (the slowest actor's,
  which is the fast site's: count-paced the whole blocking exchange, time-paced only the wait for the other group to
  arrive), and, like for like in both modes, the share of `comm wait` (every second blocked at the outer step: the
  wait and the exchange itself; with one replica per site nothing else waits).
- the most inner steps a group took in a step, the inner steps of both groups together in each outer period (the
  slow group's are inner_steps of them), the slowdown the step lines carry, and the final validation loss.

Data: the Debian fortunes corpus (`geotrain data prepare`, 1% for validation) and gpt2-demo, as diloco_study.py; the
workers run with OMP_NUM_THREADS=--threads (one each: two workers on two cores). Figures of site b, and of every
job that runs on it, are EMULATED (its compute is slowed by a wait).

Other work on the machine: with the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled) a job
at nice 19 in another session takes as large a share of the cores as each of the cluster's processes (each in its
own session), since nice values weigh only inside a session. --cluster-nice N sets the cluster's sessions' autogroup
nice (the recorded runs: -10), so that such a job yields to the cluster as its nice value asks.

Writes --csv (unequal_sites.csv: a row per run) and --log (unequal_sites.log: every run's output, its step lines
with their arrival times) in --out; prints a line per figure and a summary table.

Usage: /usr/bin/python3 bench/geo/unequal_sites.py [--geotrain build/bin/geotrain] [--out docs/results/data/geo]
           [--steps 64] [--solo-steps 12] [--inner-steps 8] [--slowdown 2] [--repeats 3] [--batch 16]
           [--latency-ms 0] [--bandwidth-mbps 1000] [--threads 1] [--cluster-nice N] [--data fortunes|DIR]
           [--model YAML]
From the checkout, with PYTHONPATH=tests/lib (the shared code: geotrain_testing); hold the build lock around it
(`flock /tmp/geotrain-build.lock ...`) so that no build shares the cores with the cluster.
"""
import argparse
import csv
import os
import re
import shutil
import statistics
import subprocess
import threading
import time

from geotrain_testing.clusters import private_cluster_env, run
from geotrain_testing.logs import cluster_steps
from diloco_study import STUDY_LR, STUDY_MODEL, spec_text  # bench/geo/, beside this script

SEQ_LEN = 64  # diloco_study.spec_text's train.seq_len
GOAL_IDLE, GOAL_RATE, GOAL_LOSS = 0.05, 0.9, 0.015


def job_spec(name, data, steps, model, kind, inner_steps, batch, seed):
    """The study's job (diloco_study.spec_text) as `kind`: solo-a / solo-b (dp 1 on that site, batch / 2
    sequences), count (DiLoCo, sync steps) or time (DiLoCo, sync time), one replica per site; evaluated at the end."""
    if kind.startswith("solo-"):
        parallel = (f"{{plan: manual, dp: 1, microbatches: 1, "
                    f"placement: [{{replica: 0, stage: 0, site: {kind[5:]}}}]}}")
        return spec_text(name, data, steps, steps, model, "sync", batch=batch // 2, seed=seed, parallel=parallel)
    parallel = ("{plan: manual, dp: 2, microbatches: 1, sync: diloco, placement: "
                "[{replica: 0, stage: 0, site: a}, {replica: 1, stage: 0, site: b}]}")
    text = spec_text(name, data, steps, steps, model, "diloco", inner_steps, codec="int8", outer=(1.0, 0.0),
                     fragments=1, lr=STUDY_LR, seed=seed, batch=batch, parallel=parallel)
    sync = "time" if kind == "time" else "steps"
    lines = [line[:-1] + f", sync: {sync}}}" if line.startswith("diloco: {") else line for line in text.split("\n")]
    if not any(f"sync: {sync}}}" in line for line in lines):
        raise RuntimeError(f"no diloco block to add sync: {sync} to in the study's spec:\n{text}")
    return "\n".join(lines)


def follow_job(geotrain, path, env, timeout):
    """`job submit PATH --follow`: its output and, for each step line, the time.monotonic() of its arrival."""
    p = subprocess.Popen([geotrain, "job", "submit", path, "--follow"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    lines, arrival = [], {}
    try:
        for line in p.stdout:
            now = time.monotonic()
            lines.append(line)
            for s in cluster_steps(line):
                arrival[s["step"]] = now
        rc = p.wait()
    finally:
        timer.cancel()
    out = "".join(lines)
    if rc != 0:
        raise RuntimeError(f"job submit {path} --follow failed ({rc}):\n{out[-3000:]}")
    return out, arrival


def window_figures(steps, arrival, first, last, unit):
    """Figures over steps first..last (1-based, inclusive): wall seconds from the arrival of step first-1's line to
    step last's, tokens (each step's tokens/s x step seconds, rounded to whole replica batches of `unit` tokens),
    outer sync and comm wait seconds summed."""
    window = [s for s in steps if first <= s["step"] <= last]
    wall = arrival[last] - arrival[first - 1]
    per_wall = 1 / wall if wall > 0 else float("nan")  # the head's stamps (whole seconds) can coincide
    tokens = sum(step_tokens(s, unit) for s in window)
    outer = sum((s["outer_sync_s"] or 0.0) for s in window)
    blocked = sum(s["comm_wait_s"] for s in window)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens * per_wall, "outer_sync_s": outer,
            "idle_share": outer * per_wall, "comm_wait_s": blocked, "blocked_share": blocked * per_wall,
            "head_tokens_per_s_median": statistics.median(s["tokens_per_s"] for s in window),
            "step_s_sum": sum(s["step_s"] for s in window)}


def step_tokens(step, unit):
    """A step's tokens: its line's tokens/s x step seconds (both rounded in the line), to whole replica batches."""
    return round(step["tokens_per_s"] * step["step_s"] / unit) * unit


def write_spec(args, work, name, kind, steps, repeat):
    path = os.path.join(work, f"{name}-r{repeat}.yaml")
    with open(path, "w") as f:
        f.write(job_spec(name, args.data_dir, steps, args.model, kind, args.inner_steps, args.batch, args.seed))
    return path


def checked_steps(name, steps, out, arrival):
    got = cluster_steps(out)
    if len(got) != steps or got[-1]["val_loss"] is None or sorted(arrival) != list(range(1, steps + 1)):
        raise RuntimeError(f"{name}: expected {steps} step lines, the last with a validation loss:\n{out[-3000:]}")
    return got


def measure(args, geotrain, env, work, name, kind, steps, repeat, log):
    """One job on the cluster, followed to its end: its row of figures."""
    path = write_spec(args, work, name, kind, steps, repeat)
    started = time.strftime("%H:%M:%S", time.gmtime())
    out, arrival = follow_job(geotrain, path, env, timeout=args.job_timeout)
    return figures(args, name, kind, steps, repeat, out, arrival, checked_steps(name, steps, out, arrival), started,
                   log)


def measure_solos_together(args, geotrain, env, work, repeat, rates, log):
    """solo-a and solo-b submitted at the same time (each site then shares the machine with the other, as in the
    DiLoCo jobs): site a for as many more steps as it is faster alone (`rates`: the solo rates of this repeat), so
    that both run about as long; each one's median tokens/s over its steps 2 to N-1 whose lines the head stamped no
    later than the other job's step N-1 (both running).

    Neither job is followed: while two jobs run, the head's WatchJob of one wakes at every event of the other and
    finds nothing of its own (JobManager::WaitEvents takes the global event sequence as its hint), so that it spins
    and takes most of a core. Their logs are read (`job logs`) every two seconds instead, and the step lines' times
    are the head's stamps (whole seconds)."""
    steps = {"a": max(args.solo_steps, round(args.solo_steps * rates["a"] / rates["b"])), "b": args.solo_steps}
    started = time.strftime("%H:%M:%S", time.gmtime())
    jobs = {}
    for site in ("a", "b"):
        path = write_spec(args, work, f"solo-{site}-together", f"solo-{site}", steps[site], repeat)
        submitted = run([geotrain, "job", "submit", path], env)
        match = re.search(r"submitted (\S+)", submitted)
        if not match:
            raise RuntimeError(f"job submit {path}: no job id in its output:\n{submitted}")
        jobs[site] = match.group(1)
    deadline = time.monotonic() + args.job_timeout
    logs = {}
    while True:
        logs = {site: run([geotrain, "job", "logs", job], env) for site, job in jobs.items()}
        if all(re.search(r"\b(SUCCEEDED|FAILED|CANCELLED)\b", out) for out in logs.values()):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"solos together: not finished after {args.job_timeout:g} s:\n{logs}")
        time.sleep(2)
    results = {}
    for site in ("a", "b"):
        arrival = {}
        for line in logs[site].splitlines():
            stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) ", line)
            for s in cluster_steps(line):
                arrival[s["step"]] = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S"))
        results[site] = (logs[site], arrival,
                         checked_steps(f"solo-{site}-together", steps[site], logs[site], arrival))
    rows = []
    for site, other in (("a", "b"), ("b", "a")):
        until = results[other][1][steps[other] - 1]
        rows.append(figures(args, f"solo-{site}-together", f"solo-{site}", steps[site], repeat, *results[site],
                            started, log, overlap_until=until))
        rows[-1]["step_times"] = "head stamps (whole seconds)"
    return rows


def figures(args, name, kind, steps, repeat, out, arrival, got, started, log, overlap_until=None):
    """A run's row of figures (module docstring) from its step lines and their arrivals; with overlap_until (a solo
    job run beside the other site's), its solo rate over the steps whose lines arrived by then."""
    unit = (args.batch // 2) * SEQ_LEN  # one replica's batch of one inner step
    row = {"run": name, "repeat": repeat, "sync": {"count": "steps", "time": "time"}.get(kind, "-"),
           "started_utc": started, "step_times": "arrival at job submit --follow", "steps": steps,
           "inner_steps": args.inner_steps if kind in ("count", "time") else 0,
           "slowdown_b": args.slowdown, "emulated": any(s["slowdown"] > 1 for s in got),
           "max_slowdown_in_lines": max(s["slowdown"] for s in got),
           "tokens_total": sum(step_tokens(s, unit) for s in got), "val_loss": got[-1]["val_loss"],
           "max_inner_steps": max(s["inner_steps"] for s in got),
           "outer_sync_s_all_steps": sum((s["outer_sync_s"] or 0.0) for s in got),
           # inner steps of both groups together in each outer period (the slow group takes inner_steps of them)
           "inner_steps_per_period": " ".join(
               str(sum(step_tokens(s, unit) // unit for s in got[i:i + args.inner_steps]))
               for i in range(0, steps, args.inner_steps)) if kind in ("count", "time") else ""}
    for label, first in (("all", 2), ("steady", args.inner_steps + 1)):
        if kind.startswith("solo-") and label == "steady":
            continue
        for key, value in window_figures(got, arrival, first, steps - 1, unit).items():
            row[f"{label}_{key}"] = value
    if kind.startswith("solo-"):
        timed = [s for s in got[1:-1] if overlap_until is None or arrival[s["step"]] <= overlap_until]
        if not timed:
            raise RuntimeError(f"{name}: no step ran while the other site's job did")
        row["solo_tokens_per_s_median"] = statistics.median(s["tokens_per_s"] for s in timed)
        row["solo_timed_steps"] = len(timed)
    t0 = arrival[1]
    log.write(f"==== {name} repeat {repeat} (started {started} UTC; +seconds: arrival after step 1's line)\n")
    for line in out.splitlines():
        s = cluster_steps(line)
        log.write(f"+{arrival[s[0]['step']] - t0:8.3f} {line}\n" if s else f"          {line}\n")
    log.flush()
    print(describe(row), flush=True)
    return row


def describe(row):
    """One line for a run's figures."""
    label = " (EMULATED slowdown)" if row["emulated"] else ""
    if row["run"].startswith("solo-"):
        return (f"{row['run']} repeat {row['repeat']}{label}: {row['solo_tokens_per_s_median']:.1f} tokens/s (median "
                f"of {row['solo_timed_steps']} steps from step 2), wall {row['all_tokens_per_s']:.1f} tokens/s, "
                f"val loss {row['val_loss']:.4f}")
    return (f"{row['run']} repeat {row['repeat']}{label}: steps 2-{row['steps'] - 1} wall {row['all_wall_s']:.1f} s, "
            f"{row['all_tokens_per_s']:.1f} tokens/s, outer sync {row['all_idle_share']:.1%} of wall "
            f"(blocked {row['all_blocked_share']:.1%}); steps {row['inner_steps'] + 1}-{row['steps'] - 1} "
            f"{row['steady_tokens_per_s']:.1f} tokens/s, outer sync {row['steady_idle_share']:.1%} "
            f"(blocked {row['steady_blocked_share']:.1%}); at most {row['max_inner_steps']} inner steps a step; "
            f"{row['tokens_total']} tokens, final val loss {row['val_loss']:.4f}; inner steps of both groups per "
            f"period {row['inner_steps_per_period']}")


def prioritise(env, nice):
    """Sets the autogroup nice value (/proc/PID/autogroup) of every process of the cluster in env's GEOTRAIN_HOME to
    `nice`; returns their names. With the kernel's autogroup scheduling on (/proc/sys/kernel/sched_autogroup_enabled)
    each session shares the CPU equally with every other session whatever its processes' nice values, and `cluster
    up` starts each process in its own session: a job at nice 19 in another session then takes as large a share of
    the cores as each worker. A lower autogroup nice gives the cluster's sessions the weight that plain nice values
    would give them without autogroups."""
    with open(os.path.join(env["GEOTRAIN_HOME"], "cluster", "cluster.json")) as f:
        processes = re.findall(r'"name": "([^"]+)", "pid": "(\d+)"', f.read())
    if not processes:
        raise RuntimeError("--cluster-nice: no processes in the cluster's record (cluster.json)")
    for _, pid in processes:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    return [name for name, _ in processes]


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def summary(rows, args):
    """The summary table and the goals, from the medians over the repeats."""
    def med(run, key):
        values = [r[key] for r in rows if r["run"] == run and key in r]
        return statistics.median(values) if values else float("nan")
    solo_a, solo_b = med("solo-a", "solo_tokens_per_s_median"), med("solo-b", "solo_tokens_per_s_median")
    ideal = solo_a + solo_b
    both_a = med("solo-a-together", "solo_tokens_per_s_median")
    both_b = med("solo-b-together", "solo_tokens_per_s_median")
    both = both_a + both_b
    print(f"\nsummary (median over {args.repeats} repeat(s); site b slowed {args.slowdown:g}x: EMULATED slowdown; "
          f"{args.latency_ms:g} ms one way, {args.bandwidth_mbps:g} Mbit/s between the sites)")
    print(f"solo a {solo_a:.1f} tokens/s, solo b {solo_b:.1f} tokens/s (EMULATED), sum {ideal:.1f}")
    print(f"solo a and solo b at the same time: {both_a:.1f} + {both_b:.1f} (EMULATED) = {both:.1f} tokens/s "
          f"({both / ideal:.3f} x the sum alone)")
    print(f"| run | window | wall s | tokens/s | x (solo a + solo b) | x (a + b at the same time) | outer sync share | "
          f"blocked share | max inner steps | final val loss | tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run_name in ("count-paced", "time-paced", "count-paced-equal-tokens"):
        if not any(r["run"] == run_name for r in rows):
            continue
        for window in ("all", "steady"):
            print(f"| {run_name} | {window} | {med(run_name, window + '_wall_s'):.1f} | "
                  f"{med(run_name, window + '_tokens_per_s'):.1f} | "
                  f"{med(run_name, window + '_tokens_per_s') / ideal:.3f} | "
                  f"{med(run_name, window + '_tokens_per_s') / both:.3f} | "
                  f"{med(run_name, window + '_idle_share'):.1%} | {med(run_name, window + '_blocked_share'):.1%} | "
                  f"{med(run_name, 'max_inner_steps'):.0f} | {med(run_name, 'val_loss'):.4f} | "
                  f"{med(run_name, 'tokens_total'):.0f} |")
    for window in ("all", "steady"):
        idle = med("time-paced", window + "_idle_share")
        blocked = med("time-paced", window + "_blocked_share")
        rate = med("time-paced", window + "_tokens_per_s") / ideal
        print(f"goal, time-paced {window}: fast-site idle (outer sync) {idle:.1%} < {GOAL_IDLE:.0%}: "
              f"{'met' if idle < GOAL_IDLE else 'NOT met'} (blocked, wait and exchange: {blocked:.1%}); tokens/s "
              f"{rate:.3f} x (solo a + solo b) >= {GOAL_RATE}: {'met' if rate >= GOAL_RATE else 'NOT met'} "
              f"({med('time-paced', window + '_tokens_per_s') / both:.3f} x the two at the same time)")
    if any(r["run"] == "count-paced-equal-tokens" for r in rows):
        gap = med("time-paced", "val_loss") / med("count-paced-equal-tokens", "val_loss") - 1
        print(f"goal, loss: time-paced final val loss {med('time-paced', 'val_loss'):.4f} vs count-paced at equal "
              f"tokens {med('count-paced-equal-tokens', 'val_loss'):.4f}: {gap:+.2%} (within {GOAL_LOSS:.1%}: "
              f"{'met' if abs(gap) <= GOAL_LOSS else 'NOT met'}); count-paced at equal steps "
              f"{med('count-paced', 'val_loss'):.4f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geotrain", default="build/bin/geotrain")
    ap.add_argument("--out", default="docs/results/data/geo")
    ap.add_argument("--csv", default="unequal_sites.csv", help="a row per run, in --out")
    ap.add_argument("--log", default="unequal_sites.log", help="every run's output, in --out")
    ap.add_argument("--data", default="fortunes", help="fortunes (default) or a directory of train_*.bin, val_*.bin")
    ap.add_argument("--model", default=STUDY_MODEL)
    ap.add_argument("--steps", type=int, default=64, help="steps of the DiLoCo jobs")
    ap.add_argument("--solo-steps", type=int, default=12, help="steps of each solo job")
    ap.add_argument("--inner-steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="global batch of the DiLoCo jobs (sequences of 64 tokens)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slowdown", type=float, default=2.0, help="site b's worker --slowdown (EMULATED)")
    ap.add_argument("--repeats", type=int, default=3, help="solo-a, solo-b, count-paced, time-paced, in turn")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one way between the sites (emulated)")
    ap.add_argument("--bandwidth-mbps", type=float, default=1000.0)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the workers")
    ap.add_argument("--cluster-nice", type=int, default=None,
                    help="the autogroup nice value (-20 to 19) of the cluster's processes (default: left as it is); "
                         "with autogroup scheduling a nice 19 job in another session otherwise shares the cores "
                         "equally with each worker (prioritise)")
    ap.add_argument("--no-equal-tokens", action="store_true", help="skip the count-paced run at equal tokens")
    ap.add_argument("--job-timeout", type=float, default=1800)
    args = ap.parse_args()
    if args.steps < 2 * args.inner_steps + 2:
        ap.error(f"--steps {args.steps} must be at least 2 x --inner-steps + 2: a paced period and the end")
    if args.solo_steps < 3 or args.batch % 2 or args.repeats < 1 or args.slowdown < 1:
        ap.error("--solo-steps >= 3, an even --batch, --repeats >= 1 and --slowdown >= 1")
    geotrain = os.path.abspath(args.geotrain)
    os.makedirs(args.out, exist_ok=True)
    work, env = private_cluster_env("geotrain_unequal_", OMP_NUM_THREADS=str(args.threads))
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; {uptime()}", flush=True)
    rows = []
    try:
        args.data_dir = os.path.abspath(args.data) if args.data != "fortunes" else os.path.join(work, "data")
        if args.data == "fortunes":
            run([geotrain, "data", "prepare", "/usr/share/games/fortunes", "--out", args.data_dir,
                 "--val-fraction", "0.01"], env)
        topo = os.path.join(work, "topo.yaml")
        with open(topo, "w") as f:
            f.write("sites:\n  - {name: a, workers: [{device: RTX6000}]}\n"
                    "  - {name: b, workers: [{device: RTX6000}]}\n"
                    f"links:\n  - {{a: a, b: b, latency_ms: {args.latency_ms:g}, "
                    f"bandwidth_mbps: {args.bandwidth_mbps:g}, jitter_ms: 0}}\n")
        run([geotrain, "cluster", "up", topo, "--slowdown", f"b={args.slowdown:g}"], env)
        if args.cluster_nice is not None:
            names = prioritise(env, args.cluster_nice)
            print(f"autogroup nice {args.cluster_nice} for {', '.join(names)}", flush=True)
        with open(os.path.join(args.out, args.log), "w") as log:
            try:
                for repeat in range(1, args.repeats + 1):
                    for site in ("a", "b"):
                        rows.append(measure(args, geotrain, env, work, f"solo-{site}", f"solo-{site}",
                                            args.solo_steps, repeat, log))
                    rates = {site: rows[-2 + i]["solo_tokens_per_s_median"] for i, site in enumerate("ab")}
                    rows += measure_solos_together(args, geotrain, env, work, repeat, rates, log)
                    for name, kind in (("count-paced", "count"), ("time-paced", "time")):
                        rows.append(measure(args, geotrain, env, work, name, kind, args.steps, repeat, log))
                if not args.no_equal_tokens:
                    tokens = statistics.median(r["tokens_total"] for r in rows if r["run"] == "time-paced")
                    equal_steps = round(tokens / (args.batch * SEQ_LEN))
                    print(f"count-paced-equal-tokens: {equal_steps} steps of {args.batch * SEQ_LEN} tokens for the "
                          f"time-paced runs' {tokens:.0f}", flush=True)
                    rows.append(measure(args, geotrain, env, work, "count-paced-equal-tokens", "count",
                                        equal_steps, 1, log))
            finally:
                subprocess.run([geotrain, "cluster", "down"], env=env, capture_output=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        print(f"end {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; {uptime()}", flush=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(os.path.join(args.out, args.csv), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    summary(rows, args)


if __name__ == "__main__":
    main()
