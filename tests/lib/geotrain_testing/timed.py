"""What the timed-compute studies share (bench/geo/fabric_study.py, bench/geo/validate_timed.py,
bench/geo/timed_compute_bench.py; tested by tests/control/study_harness_test.py): topologies and job specs, running
one plan on a `cluster up --timed-compute` cluster, the planner's prediction of a plan, and the calibration of the
planner's model to this machine.

Calibration. A timed cluster computes in the emulated GPUs' time but communicates through this machine: inside a
site, a collective goes over gRPC on loopback, all actors sharing two cores, not over NVLink or a 100 Gbit/s NIC.
The planner's defaults describe real nodes, so before predicting, three figures are fitted with jobs that no study
plan is (the bandwidths on the studies' own clusters, below; on a profiling cluster of one site and two devices only
for validate_timed.py --no-refit):
  - each device type's efficiency: the planner's compute time of a microbatch at efficiency 1 over what the timed
    backend waits for it (`geotrain model timed-step`), on the tensor cores (NAME) and in fp32 (NAME@fp32, the
    CUDA cores, where less of the step waits for memory: 0.57-0.59 against 0.43-0.44), which a plan that trains in
    fp32 takes (a Turing GPU with the int8 codec: the head resolves precision auto to fp32 there);
  - the bandwidth inside a site for gradients: --intra-site-gbps solved so that the planner's prediction of
    DP2 inside the site (1.4 GB of gradients all-reduced over loopback for GPT-2 medium) equals its measured step;
  - the bandwidth inside a site for activations: the same on --intra-site-activation-gbps for TP2 inside the site
    (many all-reduces of one microbatch's activations, 4 MB each), with that bandwidth for the rest. Messages of
    a few MB and of hundreds of MB move at different rates per byte on loopback
    (docs/results/2026-12-04-pair-exchange.md):
    fitted as one bandwidth, the TP2 job was predicted 12-30% slow at the least latency allowed (2026-12-04), and
    the pipelines' sends, which are activations too, with it. The latency inside a site stays the planner's
    default (0.05 ms);
Nothing is fitted across sites: the links are the topology's. The window of a stream across sites
(--wan-window-mb) was fitted here until 2026-12-05, on DP2 across a 1 Gbit/s link of 40 ms one way; it stood in
for what the planner did not model, each gradient bucket's round trips (a bucket is an all-reduce of its own, and
each send waits for its ack). With those modelled, that job is predicted within 5% with no window, and a fitted
window (8 MB) capped the tied embedding's 51 MB messages, which the 103 ms runs show cross at the link's rate.
Both studies fit the two bandwidths inside a site on their own clusters instead of the profiling cluster
(refit_inside_site: the same DP2 and TP2 jobs, on two devices of a site), since this host drifts between spells of
minutes and one round of those jobs varies by about 10% from the next: bench/geo/validate_timed.py runs a round
on each topology's cluster before its plans, to rank them, and one between each later round of the plans;
bench/geo/fabric_study.py one on each round trip's cluster before its plans. Their final predictions use the
median of every round. Nothing is fitted to a study's own runs (the profiling jobs are none of the plans studied).

Every prediction also says that the sites share one host (`--sites-share-one-host`: the sites a plan uses divide
the bandwidth inside a site, and a collective's ranks the host's throughput, since they all run at once on the same
two cores) and that collectives are gRPC's (`--grpc-collectives`: data parallelism across sites is gRPC's hierarchical
all-reduce where a site holds several replicas, else a ring, as the runtime runs it without NCCL; a flat ring
before 2026-12-06). Without the first, the planner predicted half the measured step of TP inside both
sites x PP (GPT-2 medium: 7.5 s vs 15.0 s) and a tenth of DP over 16 devices.
"""
import json
import os
import statistics
import subprocess
import time

from geotrain_testing.logs import cluster_steps

def write_topology(path, sites, links):
    """sites: [(name, [(device, count per worker), ...])]; links: [(a, b, one-way ms, Mbit/s)]."""
    with open(path, "w") as f:
        f.write("sites:\n")
        for name, workers in sites:
            ws = ", ".join(f"{{device: {d}, count: {n}}}" for d, n in workers)
            f.write(f"  - {{name: {name}, workers: [{ws}]}}\n")
        if links:
            f.write("links:\n")
            for a, b, ms, mbps in links:
                f.write(f"  - {{a: {a}, b: {b}, latency_ms: {ms:g}, bandwidth_mbps: {mbps:g}, jitter_ms: 0}}\n")


def write_job(path, name, model, data, parallel, steps, batch, codec="bf16", precision="auto"):
    with open(path, "w") as f:
        f.write(f"name: {name}\nmodel: {{preset: {model}}}\ndata: {{train: '{data}'}}\n"
                f"train: {{steps: {steps}, global_batch: {batch}, seq_len: 1024, precision: {precision}}}\n"
                f"parallel: {parallel}\ncomm: {{wan_codec: {codec}}}\n")


def steady_steps(expected_s):
    """(steps to run, first steps left out of the medians) for a plan expected to take expected_s seconds per step.
    A job's first steps are slower (connections open, flow-control windows grow, buffers are allocated): GPT-2
    medium PP4 on timed A30s took 1.07, 1.04 and 0.76 s in steps 2-4 of its first run, 0.63-0.81 s after. Short
    steps run 12 and skip 3 (a median of 9 steps: a few seconds more per plan); long ones, where that costs little,
    run 3 and skip 1; steps of 20 s or more, which each average over a long spell of the host already (DP over 8-16
    timed devices: 25-82 s, where a third step cost the validation 4.5 minutes), run 2 and skip 1."""
    if expected_s < 5:
        return (12, 3)
    return (3, 1) if expected_s < 20 else (2, 1)


def run_job(cluster, spec, timeout, warmup=1):
    """Runs a job spec on the cluster; returns a dict: state, message, step_s, compute_s, comm_wait_s, wan_mb and
    wan_bytes (medians of the steps after the first `warmup`), wall_s."""
    started = time.monotonic()
    job_id = cluster.cli(["job", "submit", spec]).stdout.split()[1]
    try:
        job = cluster.wait_job(job_id, timeout)
    except (AssertionError, subprocess.TimeoutExpired):
        # Timed out: cancelled, so that it does not run on beside what the study measures next on this cluster.
        cluster.cli(["job", "cancel", job_id], check=False)
        raise
    out = {"state": job["state"].replace("JOB_", ""), "message": "", "step_s": "", "compute_s": "",
           "comm_wait_s": "", "wan_mb": "", "wall_s": round(time.monotonic() - started, 1)}
    if job["state"] != "JOB_SUCCEEDED":
        out["message"] = (job.get("message") or "")[:300]
        return out
    timed = [s for s in cluster_steps(cluster.logs(job_id)) if s["emulated"]]
    steps = [s for s in timed if s["step"] > warmup] or timed
    out.update(step_s=round(statistics.median(s["step_s"] for s in steps), 4),
               compute_s=round(statistics.median(s["compute_s"] for s in steps), 4),
               comm_wait_s=round(statistics.median(s["comm_wait_s"] for s in steps), 4),
               wan_bytes=int(statistics.median(s["wan_bytes"] for s in steps)))
    out["wan_mb"] = round(out["wan_bytes"] / 1e6, 1)
    return out


def measure_plan(cluster, geotrain, topology, flags, spec, write_spec, timeout):
    """The planner's prediction of the plan `write_spec(steps)` writes to `spec`, and run_job's figures of it run for
    steady_steps(prediction) steps: a dict as run_job's plus predicted_s ("" with the error in message when the
    planner cannot predict it)."""
    write_spec(steady_steps(0)[0])
    try:
        predicted, error = round(predict(geotrain, topology, spec, flags), 4), ""
    except RuntimeError as e:
        predicted, error = "", str(e)
    steps, warmup = steady_steps(predicted if predicted != "" else 0)
    write_spec(steps)
    row = run_job(cluster, spec, timeout, warmup)
    row["predicted_s"] = predicted
    row["warmup"] = warmup
    if error:
        row["message"] = (row["message"] + " " + error)[:300]
    return row


def measure_plans(cluster, geotrain, topology, flags, plans, timeout, rounds=1, progress=None, between_rounds=None):
    """measure_plan for each (spec, write_spec) of `plans`, in order; then, for the plans with a short step
    (steady_steps' 12 steps), rounds - 1 more rounds of their jobs, interleaved (all of them once, then again), and
    their figures the median over the rounds (each round's step in rounds_s). One job of a plan inside a site
    varies by about 10% from the next on this host (GPT-2 medium PP4 on A30s: 0.654-0.724 s, then on RTX 6000s
    0.674-0.861 s, in turn, 2026-12-05), as much as the planner's top plans differ: one job each ranked them by that
    spread. A long step is steady within a job and costs minutes a round: one round. progress(index, figures) after
    each job; between_rounds() before each round after the first (validate_timed.py runs its profiling jobs there,
    so that the calibration samples the same spells of the host as the plans; with no short plan there is no later
    round). Returns one dict per plan, as measure_plan's."""
    def report(i, figures):
        if progress:
            progress(i, figures)
        return figures
    rows = [report(i, measure_plan(cluster, geotrain, topology, flags, spec, write_spec, timeout))
            for i, (spec, write_spec) in enumerate(plans)]
    short = [i for i, row in enumerate(rows) if row["warmup"] == steady_steps(0)[1] and row["step_s"] != ""]
    runs = {i: [dict(rows[i])] for i in short}
    for _ in range(rounds - 1 if short else 0):
        if between_rounds:
            between_rounds()
        for i in short:
            runs[i].append(report(i, run_job(cluster, plans[i][0], timeout, rows[i]["warmup"])))
    for i in short:
        done = [r for r in runs[i] if r["step_s"] != ""]
        rows[i]["rounds_s"] = ";".join(str(r["step_s"]) for r in runs[i])
        for key in ("step_s", "compute_s", "comm_wait_s"):
            rows[i][key] = round(statistics.median(r[key] for r in done), 4)
        rows[i]["wall_s"] = round(sum(r["wall_s"] for r in runs[i]), 1)
        if len(done) < len(runs[i]):
            rows[i]["message"] = (rows[i]["message"] + f" {len(runs[i]) - len(done)} round(s) failed")[:300]
    return rows


def plan_json(geotrain, topology, spec, flags, predict=False, top=5):
    args = [geotrain, "plan", "--topology", topology, "--job", spec, "--json"] + list(flags)
    args += ["--predict"] if predict else ["--top", str(top)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"geotrain plan failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)


def predict(geotrain, topology, spec, flags):
    """The planner's step time (s) for the spec's manual plan as placed."""
    return plan_json(geotrain, topology, spec, flags, predict=True)["step_time_s"]


def parallel_of(plan):
    """A ranked plan of `geotrain plan --json` as a spec's parallel section (placement by worker id)."""
    place = ", ".join(f"{{replica: {p['replica']}, stage: {p['stage']}, tp_rank: {p['tp_rank']}, "
                      f"worker: {p['site']}-{p['worker']}}}" for p in plan["placement"])
    return (f"{{plan: manual, dp: {plan['dp']}, pp: {plan['pp']}, tp: {plan['tp']}, "
            f"microbatches: {plan['microbatches'][0]}, schedule: {plan['schedule']}, "
            f"pipeline_depth: {plan['pipeline_depth']}, placement: [{place}]}}")


def planner_flags(calibration):
    eff = ",".join(f"{name}={e:.5f}" for name, e in calibration["efficiency"].items())
    flags = ["--efficiency-by-device", eff, "--intra-site-gbps", f"{calibration['intra_site_gbps']:.4f}",
             "--intra-site-latency-ms", f"{calibration['intra_site_latency_ms']:.4f}", "--sites-share-one-host",
             "--grpc-collectives"]
    if calibration.get("intra_site_activation_gbps"):
        flags += ["--intra-site-activation-gbps", f"{calibration['intra_site_activation_gbps']:.4f}"]
    if calibration.get("wan_window_mb"):
        flags += ["--wan-window-mb", f"{calibration['wan_window_mb']:.4f}"]
    return flags


def load_calibration(path):
    """A calibration that fabric_study.py wrote as JSON (its final refit_inside_site), checked for what planner_flags
    needs. Exits with a message naming the file when it cannot be read or is not one."""
    hint = "give the -calibration.json that fabric_study.py wrote (docs/results/data/geo/fabric-calibration.json)"
    try:
        with open(path) as f:
            cal = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read a calibration ({e}); {hint}")
    missing = [k for k in ("efficiency", "intra_site_gbps", "intra_site_latency_ms")
               if not isinstance(cal, dict) or k not in cal]
    if missing or not isinstance(cal.get("efficiency"), dict) or not cal["efficiency"]:
        raise SystemExit(f"{path}: not a calibration (missing {', '.join(missing) or 'efficiency by device'}); {hint}")
    return cal


def _solve(f, target, lo, hi, tolerance=1e-4, iterations=40):
    """x in [lo, hi] with f(x) = target for f decreasing in x and close to a + b / x (a step time against a
    bandwidth): regula falsi (the Illinois variant) on 1 / x, where f is close to a line. Each f is a `geotrain plan
    --predict` (0.6 s of CPU here while geotrain linked cuBLAS, 0.06 s since): about 6 of them, where bisection took
    18 for the same precision."""
    def g(u):
        return f(1 / u) - target
    a, b = 1 / hi, 1 / lo
    ga, gb = g(a), g(b)
    if ga >= 0:
        return hi
    if gb <= 0:
        return lo
    side, c = 0, a
    for _ in range(iterations):
        c = (a * gb - b * ga) / (gb - ga)
        gc = g(c)
        if abs(gc) <= tolerance * target:
            break
        if gc > 0:
            b, gb = c, gc
            if side == -1:
                ga /= 2
            side = -1
        else:
            a, ga = c, gc
            if side == 1:
                gb /= 2
            side = 1
    return 1 / c


def _inside_site_jobs(site):
    """The profiling jobs inside one site: (name, parallel, expected step s)."""
    return (("dp2", "{plan: manual, dp: 2, microbatches: 4, placement: [{replica: 0, stage: 0, site: %s}, "
                    "{replica: 1, stage: 0, site: %s}]}" % (site, site), 2),
            ("tp2", "{plan: manual, tp: 2, microbatches: 8, placement: [{replica: 0, stage: 0, tp_rank: 0, "
                    "site: %s}, {replica: 0, stage: 0, tp_rank: 1, site: %s}]}" % (site, site), 10))


def _run_profiling_jobs(cluster, work, data, model, jobs, steps, timeout, tag):
    """Runs (name, parallel, expected s) jobs on the cluster; returns {name: (spec, measured step s)}."""
    measured = {}
    for name, parallel, expected_s in jobs:
        spec = os.path.join(work, f"calib-{tag}-{name}.yaml")
        run_steps, warmup = steady_steps(expected_s)
        write_job(spec, f"calib-{tag}-{name}", model, data, parallel, max(steps, run_steps), 16)
        r = run_job(cluster, spec, timeout, warmup)
        if r["state"] != "SUCCEEDED":
            raise RuntimeError(f"calibration job {name} ended {r['state']}: {r['message']}")
        measured[name] = (spec, r["step_s"])
    return measured


def _fit(geotrain, topo, cal, key, spec, target, hi):
    """cal[key] such that the planner's prediction of spec on topo equals target seconds."""
    return _solve(lambda v: predict(geotrain, topo, spec, planner_flags(dict(cal, **{key: v}))), target, 0.05, hi)


def _with_fit_record(geotrain, topo, cal, measured):
    """cal with what its profiling jobs measured (added to any earlier record) and the fitted planner's predictions
    of them."""
    cal["measured"] = dict(cal.get("measured", {}), **{name: step for name, (_, step) in measured.items()})
    cal["predicted_after_fit"] = {name: predict(geotrain, topo, spec, planner_flags(cal))
                                  for name, (spec, _) in measured.items()}
    return cal


def _fit_inside_site(geotrain, topo, cal, measured):
    cal["intra_site_gbps"] = _fit(geotrain, topo, cal, "intra_site_gbps", *measured["dp2"], 400)
    cal["intra_site_activation_gbps"] = _fit(geotrain, topo, cal, "intra_site_activation_gbps", *measured["tp2"], 400)


def calibrate(geotrain, cluster_up, work, data, model, device_types, device, steps, timeout, inside_site=True):
    """Fits the planner to this machine (see the module's comment). cluster_up(topology) -> a ClusterUp.
    inside_site=False: the efficiencies only, for a caller that fits the bandwidths inside a site on its own
    clusters (refit_inside_site); no profiling cluster runs, and the calibration's bandwidths stay unfitted."""
    efficiency = {}
    for d in device_types:
        topo = os.path.join(work, f"calib-{d}.yaml")
        write_topology(topo, [("calib", [(d, 1)])], [])
        # bf16 under the device's own name, and fp32 (its CUDA cores, where less of the step waits for memory) as
        # NAME@fp32, which the planner takes for plans that train in fp32 (a Turing GPU with an int8 codec).
        # (auto is bf16 or fp16: the tensor cores' peak, which timed-step's bf16 is.)
        for precision, timed_as, key in (("auto", "bf16", d), ("fp32", "fp32", d + "@fp32")):
            spec = os.path.join(work, f"calib-{d}-{precision}.yaml.job")
            write_job(spec, "calib", model, data, "{plan: manual, dp: 1, microbatches: 8}", steps, 16,
                      precision=precision)
            at_one = plan_json(geotrain, topo, spec, ["--efficiency", "1"], predict=True)["compute_bound_s"]
            r = subprocess.run([geotrain, "model", "timed-step", "--model", model, "--device", d, "--batch", "2",
                                "--seq-len", "1024", "--microbatches", "8", "--precision", timed_as, "--json"],
                               capture_output=True, text=True, check=True)
            waited = json.loads(r.stdout.strip().splitlines()[-1])["step_seconds"]
            efficiency[key] = at_one / waited
    cal = {"efficiency": efficiency, "intra_site_gbps": 100.0, "intra_site_activation_gbps": 0,
           "intra_site_latency_ms": 0.05, "wan_window_mb": 0}
    if not inside_site:
        return cal
    topo = os.path.join(work, "calib.yaml")
    write_topology(topo, [("calib", [(device, 2)])], [])
    c = cluster_up(topo)
    try:
        measured = _run_profiling_jobs(c, work, data, model, _inside_site_jobs("calib"), steps, timeout, "profile")
    finally:
        c.close()
    _fit_inside_site(geotrain, topo, cal, measured)
    return _with_fit_record(geotrain, topo, cal, measured)


def profile_inside_site(cluster, topo, site, work, data, model, steps, timeout):
    """One round of the profiling jobs inside a site (DP2 and TP2 on two devices of `site`) on a study's own cluster:
    {name: (spec, measured step s)}, for refit_inside_site."""
    return _run_profiling_jobs(cluster, work, data, model, _inside_site_jobs(site), steps, timeout,
                               os.path.basename(topo))


def add_profiling_round(rounds, cluster, topo, site, work, data, model, steps, timeout, say):
    """profile_inside_site, appended to `rounds` and said (say(text) prints a line). A later round's failure (a job
    that failed, timed out or was not accepted) is said and leaves the rounds before it; the first round's is
    raised, since its caller has nothing to predict with."""
    try:
        rounds.append(profile_inside_site(cluster, topo, site, work, data, model, steps, timeout))
    except (RuntimeError, AssertionError, subprocess.TimeoutExpired) as e:
        if not rounds:
            raise
        say(f"a profiling round failed, left out: {e}")
        return
    m = rounds[-1]
    say(f"profiling round {len(rounds)} inside {site}: DP2 {m['dp2'][1]} s, TP2 {m['tp2'][1]} s")


def refit_inside_site(geotrain, topo, calibration, rounds):
    """The calibration with the bandwidths inside a site refitted to a study's own cluster: `rounds` is a list of
    profile_inside_site results, and each job's step is the median over them (the efficiencies stay). One job varies
    by about 10% from the next on this host, and that spread, caught in a single refit, carried into every prediction
    of its topology (2026-12-05 20:32 UTC: a refit 6-20% fast, every plan predicted 4-22% fast); a cluster of 8-16
    worker processes is also not the profiling cluster of 3. validate_timed.py runs a round before its plans and one
    between each round of them; fabric_study.py one on each round trip's cluster."""
    measured = {name: (spec, statistics.median(r[name][1] for r in rounds)) for name, (spec, _) in rounds[0].items()}
    cal = dict(calibration)
    _fit_inside_site(geotrain, topo, cal, measured)
    cal = _with_fit_record(geotrain, topo, cal, measured)
    cal["measured_rounds"] = {name: [r[name][1] for r in rounds] for name in measured}
    return cal
