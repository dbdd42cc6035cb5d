"""DiLoCo's compressed pseudo-gradients (diloco.codec int8, int4, sparse) against synchronous DP in bf16: WAN bytes
and validation loss. Two parts of diloco_study.py (--parts codec-bytes,codecs), on the study's job and tokens:

codec-bytes  `geotrain cluster up` of the study's two sites of two workers (no emulated delay: only bytes are
             measured) and on it, for --bytes-steps steps, synchronous DP (DP=4, bf16 gradients across sites) and
             DiLoCo at inner_steps 2 with each codec of --codecs. The head's step log gives each step's bytes across
             sites: synchronous DP's per step, each codec's per outer exchange (the run's bytes / its exchanges; the
             sizes do not depend on the values, sparse's neither: it keeps a fixed count per block). Writes
             diloco_codec_bytes.csv (--bytes-csv), keeping the rows of the runs it did not measure again.
codecs       `train --local` of synchronous DP and of DiLoCo with every --inner-steps x --codecs (the pseudo-gradients
             rounded as the cluster's outer exchange rounds them, with the codecs' error feedback; the first --outer
             optimizer and --inner-lr-scale), each under every seed of --seeds, --jobs runs at a time. A run's WAN
             bytes: its steps x synchronous DP's bytes per step, or its outer exchanges x its codec's bytes per
             exchange (diloco_codec_bytes.csv in --out, from codec-bytes). Writes a row per run to --codecs-csv
             (diloco_codecs.csv) and prints the curve: WAN bytes against the final validation loss's gap to
             synchronous DP of the same seed (mean over the seeds). --known RUN@SEED=LOSS takes a run's final loss
             as already measured instead of running it again (its val_curve then reads "recorded").
"""
import concurrent.futures
import csv
import math
import os
import statistics
import subprocess

from geotrain_testing.clusters import run
from geotrain_testing.logs import cluster_steps, local_steps


def add_arguments(ap):
    ap.add_argument("--codecs", default="int8,int4,sparse",
                    help="codec-bytes, codecs: the diloco.codec values compared (sparse:F:B for other settings)")
    ap.add_argument("--jobs", type=int, default=2,
                    help="codecs: train --local runs at a time, each with OMP_NUM_THREADS = nproc / jobs (at least 1: "
                         "more OpenMP threads than cores spin at every barrier)")
    ap.add_argument("--combos", default="",
                    help="codecs: INNER_STEPS:CODEC,... the DiLoCo runs to make instead of every --inner-steps x --codecs "
                         "(e.g. 32/sparse,64/int4; '/' separates, as sparse:F:B holds colons)")
    ap.add_argument("--append", action="store_true",
                    help="codecs: add the rows to --codecs-csv if it exists (the curve printed is over all its rows)")
    ap.add_argument("--bytes-steps", type=int, default=4, help="codec-bytes: steps of each cluster job")
    ap.add_argument("--bytes-csv", default="diloco_codec_bytes.csv", help="codec-bytes' CSV, in --out")
    ap.add_argument("--codecs-csv", default="diloco_codecs.csv", help="codecs' CSV, in --out")
    ap.add_argument("--known", default="",
                    help="codecs: RUN@SEED=LOSS,... final validation losses already measured with the same settings "
                         "(train --local is deterministic), RUN being sync or INNER_STEPS/CODEC: not run again")


def codec_list(args):
    return [c for c in args.codecs.split(",") if c]


def exchanges(steps, inner_steps):
    """Outer exchanges of a run: after every multiple of inner_steps, and always after the last step."""
    return math.ceil(steps / inner_steps)


def measure_bytes(args, geotrain, data, work, env, spec_text):
    topo = os.path.join(work, "topo-bytes.yaml")
    with open(topo, "w") as f:
        f.write("sites:\n  - {name: a, workers: [{device: RTX6000}, {device: RTX6000}]}\n"
                "  - {name: b, workers: [{device: RTX6000}, {device: RTX6000}]}\n"
                "links:\n  - {a: a, b: b, latency_ms: 0, bandwidth_mbps: 1000, jitter_ms: 0}\n")
    steps, h = args.bytes_steps, 2
    runs = [("sync-dp", "sync", 0, "")] + [(f"diloco-{c}", "diloco", h, c) for c in codec_list(args)]
    rows = []
    run([geotrain, "cluster", "up", topo], env)
    try:
        for name, sync, inner, codec in runs:
            path = os.path.join(work, f"bytes-{name.replace(':', '_')}.yaml")
            with open(path, "w") as f:
                f.write(spec_text(name.replace(":", "_"), data, steps, steps, args.model, sync, inner,
                                  codec=codec or "int8", outer=args.outer[0], lr=args.lr))
            out = run([geotrain, "job", "submit", path, "--follow"], env, timeout=3600)
            got = cluster_steps(out)
            if len(got) != steps:
                raise RuntimeError(f"codec-bytes {name}: expected {steps} steps:\n{out[-3000:]}")
            total = sum(s["wan_bytes"] for s in got)
            per = total / (steps if sync == "sync" else exchanges(steps, inner))
            rows.append({"run": name, "codec": codec or "bf16 gradients", "steps": steps, "inner_steps": inner,
                         "wan_bytes_total": total, "wan_bytes_per_step_or_exchange": per,
                         "wan_bytes_by_step": " ".join(str(s["wan_bytes"]) for s in got)})
            print(f"codec-bytes {name}: {per / 1e6:.3f} MB across sites per "
                  f"{'step' if sync == 'sync' else 'outer exchange'} (steps: {rows[-1]['wan_bytes_by_step']})",
                  flush=True)
    finally:
        subprocess.run([geotrain, "cluster", "down"], env=env, capture_output=True)
    # The CSV keeps the runs measured before (other codecs), each run's latest measurement.
    path = os.path.join(args.out, args.bytes_csv)
    by_run = {}
    if os.path.exists(path):
        with open(path) as f:
            by_run = {r["run"]: r for r in csv.DictReader(f)}
    by_run.update({r["run"]: r for r in rows})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(by_run.values())
    return rows


def read_bytes(args):
    path = os.path.join(args.out, args.bytes_csv)
    if not os.path.exists(path):
        raise RuntimeError(f"codecs: {path} is missing; run --parts codec-bytes first (or with it)")
    with open(path) as f:
        return {r["run"]: float(r["wan_bytes_per_step_or_exchange"]) for r in csv.DictReader(f)}


def train_local(args, geotrain, data, work, spec_text, seed, name, sync, h, codec):
    """One train --local run: (final validation loss, the validation losses as 'step:loss ...')."""
    path = os.path.join(work, f"codecs-{name.replace(':', '_')}-s{seed}.yaml")
    with open(path, "w") as f:
        f.write(spec_text(name.replace(":", "_"), data, args.steps, args.eval_every, args.model, sync, h,
                          codec=codec or "int8", outer=args.outer[0], lr=args.lr if sync == "sync" else args.inner_lr,
                          seed=seed, batch=args.batch, inner_lr_scale=args.inner_lr_scale if h else 1.0))
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.jobs)))
    out = run([geotrain, "train", "--local", path], env, timeout=7200)
    evaluated = [s for s in local_steps(out) if s["val_loss"] is not None]
    if not evaluated:
        raise RuntimeError(f"codecs {name} seed {seed}: no validation loss:\n{out[-2000:]}")
    print(f"codecs {name} seed {seed}: final val loss {evaluated[-1]['val_loss']:.4f}", flush=True)
    return evaluated[-1]["val_loss"], " ".join(f"{s['step']}:{s['val_loss']:.4f}" for s in evaluated)


def quality_grid(args, geotrain, data, work, spec_text):
    per = read_bytes(args)
    combos = [(int(h), c) for h, c in (x.split("/", 1) for x in args.combos.split(",") if x)] or \
        [(h, c) for h in args.inner_steps for c in codec_list(args)]
    runs = [("sync-dp", "sync", 0, "")] + [(f"diloco-h{h}-{c}", "diloco", h, c) for h, c in combos]
    missing = [f"diloco-{c}" for _, sync, _, c in runs if sync == "diloco" and f"diloco-{c}" not in per]
    if missing or "sync-dp" not in per:
        raise RuntimeError(f"codecs: {args.bytes_csv} lacks {', '.join(missing) or 'sync-dp'}: measure them first")
    known = {}
    for item in (x for x in args.known.split(",") if x):
        run_seed, loss = item.split("=")
        what, seed = run_seed.split("@")
        known[(int(seed), "sync-dp" if what == "sync" else f"diloco-h{what.replace('/', '-', 1)}")] = float(loss)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {(seed, name): pool.submit(train_local, args, geotrain, data, work, spec_text, seed, name, sync, h,
                                             codec)
                   for seed in args.seeds for name, sync, h, codec in runs if (seed, name) not in known}
        results = {key: f.result() for key, f in futures.items()}
    results.update({key: (loss, "recorded") for key, loss in known.items() if key[0] in args.seeds})
    sync_bytes = per["sync-dp"] * args.steps
    rows = []
    for seed in args.seeds:
        reference = results[(seed, "sync-dp")][0]
        for name, sync, h, codec in runs:
            loss, curve = results[(seed, name)]
            n = exchanges(args.steps, h) if h else args.steps
            wan = per["sync-dp"] * n if sync == "sync" else per[f"diloco-{codec}"] * n
            rows.append({"seed": seed, "run": name, "inner_steps": h, "codec": codec or "bf16 gradients",
                         "steps": args.steps, "outer_lr": args.outer[0][0], "outer_momentum": args.outer[0][1],
                         "inner_lr_scale": args.inner_lr_scale if h else "", "val_loss": loss,
                         "gap_pct": 100 * (loss / reference - 1), "exchanges_or_steps": n, "wan_bytes": wan,
                         "fewer_bytes_than_sync": sync_bytes / wan, "val_curve": curve})
    path = os.path.join(args.out, args.codecs_csv)
    earlier = []
    if args.append and os.path.exists(path):
        with open(path) as f:
            earlier = list(csv.DictReader(f))
    # A run of a seed measured again (or given again with --known) replaces its earlier row.
    mine = {(str(r["seed"]), r["run"]) for r in rows}
    every = {(str(r["seed"]), r["run"]): r for r in earlier if (str(r["seed"]), r["run"]) not in mine}
    every.update({(str(r["seed"]), r["run"]): r for r in rows})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(every.values())
    print_curve(list(every.values()), args.steps, sync_bytes)
    return rows


def print_curve(rows, steps, sync_bytes):
    """The curve: each DiLoCo run's WAN bytes against its final validation loss's gap, the mean over its seeds."""
    print(f"codecs: {steps} steps, synchronous DP sends {sync_bytes / 1e6:.1f} MB across sites", flush=True)
    print("| inner_steps | codec | WAN MB | fewer bytes than sync | gap to sync (mean) | per seed |", flush=True)
    names = dict.fromkeys(r["run"] for r in rows if r["run"] != "sync-dp")
    for name in sorted(names, key=lambda n: float(next(r["wan_bytes"] for r in rows if r["run"] == n))):
        mine = [r for r in rows if r["run"] == name]
        gaps = [float(r["gap_pct"]) for r in mine]
        print(f"| {mine[0]['inner_steps']} | {mine[0]['codec']} | {float(mine[0]['wan_bytes']) / 1e6:.2f} | "
              f"{float(mine[0]['fewer_bytes_than_sync']):.0f}x | {statistics.mean(gaps):+.2f}% | " +
              ", ".join(f"{g:+.2f}% (seed {r['seed']})" for g, r in zip(gaps, mine)) + " |", flush=True)
