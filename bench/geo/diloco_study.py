#!/usr/bin/env python3
"""DiLoCo vs synchronous data parallelism across two sites: quality, WAN bytes and step time.

Two parts, both on the same tokens for every run:

quality  `geotrain train --local` of the same job (4 replicas, two per site: sites a a b b), synchronous DP and
         DiLoCo with each of --inner-steps under each outer optimizer of --outer (LR:MOMENTUM, Nesterov), the
         pseudo-gradients rounded by --quality-codec as the cluster's outer exchange rounds them (default none: the
         study's recorded figures averaged exactly; int8 is what the cluster part sends). The simulation is the cluster's
         algorithm (the stage-actor tests check that a two-site cluster run equals it); validation loss every
         --eval-every steps; every run once per initialisation seed of --seeds, with the gap to synchronous DP
         per seed and its mean. The DiLoCo runs' inner AdamW takes --inner-lr (default --lr, the synchronous
         run's) and the spec's diloco.inner_lr_scale --inner-lr-scale (default 1: the schedule as it is; above 1
         it is capped at the peak rate). Writes diloco_quality.csv and diloco_val_loss.png (the mean over the seeds; with a --batch
         other than 16, diloco_quality_batchN.csv and diloco_val_loss_batchN.png; likewise _stepsN for --steps
         other than 256, _lrX for an --lr other than 2e-3, _innerlrX for an --inner-lr other than --lr,
         _innerscaleX for an --inner-lr-scale other than 1,
         _LAYERSxCHANNELS for another --model, which --data synthetic's 512-token model is: _4x128; _CODEC for a
         --quality-codec other than none).
         --warm-start N starts the DiLoCo runs from the synchronous run's checkpoint at step N (the sites
         synchronous until then; files _warmN).
codec-bytes, codecs  compressed pseudo-gradients (bench/geo/diloco_codecs.py): the WAN bytes of synchronous DP (bf16) and
         of one outer exchange in each codec of --codecs, measured on a cluster, and the validation loss of DiLoCo
         with each --inner-steps x --codecs against synchronous DP, by `train --local` (the cluster's rounding, error
         feedback included), every seed of --seeds; writes diloco_codec_bytes.csv and diloco_codecs.csv.
cluster  `geotrain cluster up` of two sites of two workers (emulated WAN, geotrain-netem) at 0 ms and at
         --latency-ms one way, --bandwidth-mbps, and the same job for --cluster-steps steps, synchronous DP
         (DP=4, bf16 gradients across sites), DiLoCo (int8 pseudo-gradients, --cluster-fragments fragments,
         the first --outer optimizer) and the synchronous hybrid plans of --hybrids (bf16 across sites: PP=4,
         DP2 x PP2 with pipelines across the sites, DP2 x PP2 and DP2 x TP2 with DP across them), --repeats times
         with the latencies in turn: wall time and WAN bytes per step (from the head's step log; the mean over
         steps 2 to N-1, sync steps included) and the validation loss at the last step. Prints the best hybrid
         plan (the fastest at --latency-ms); writes --cluster-csv (diloco_cluster.csv). --baselines "" runs
         the hybrid plans alone.

Data: the Debian fortunes corpus tokenized by `geotrain data prepare` (GPT-2 BPE, 1% for validation) and the
gpt2-demo model, as `make demo` trains; `--data synthetic` takes the structured synthetic tokens and a 512-token
vocabulary instead, `--data DIR` any prepared directory (train_*.bin, val_*.bin).

Usage: /usr/bin/python3 bench/geo/diloco_study.py [--geotrain build/bin/geotrain] [--out docs/results/data/geo]
           [--data fortunes|synthetic|DIR] [--steps 256] [--inner-steps 8,32,128] [--outer 1.0:0,0.7:0.9]
           [--quality-fragments 1] [--seeds 1] [--lr 2e-3] [--inner-lr LR] [--inner-lr-scale 1] [--batch 16] [--warm-start N]
           [--model YAML] [--parts quality,cluster]
           [--repeats 3] [--cluster-steps 34] [--cluster-fragments 4] [--hybrids PLAN,...]
           [--baselines sync-dp,diloco] [--cluster-csv diloco_cluster.csv]
           [--codecs int8,int4,sparse] [--jobs 2]  (with --parts codec-bytes,codecs)
From the checkout, with PYTHONPATH=tests/lib (the shared code: geotrain_testing).
"""
import argparse
import csv
import os
import re
import shutil
import statistics
import subprocess

from geotrain_testing.clusters import private_cluster_env, run
from geotrain_testing.logs import cluster_steps, local_steps
from geotrain_testing.shards import write_pattern_shard
import diloco_codecs as codecs_study  # bench/geo/, beside this script
from run_study import PLANS

SITES = "[{replica: 0, stage: 0, site: a}, {replica: 1, stage: 0, site: a}, " \
        "{replica: 2, stage: 0, site: b}, {replica: 3, stage: 0, site: b}]"


# The study's settings (docs/geo-study.md); the quality part names its files by whatever differs from them.
STUDY_STEPS, STUDY_BATCH, STUDY_LR, STUDY_MODEL = 256, 16, 2.0e-3, "{preset: gpt2-demo}"


def run_lr(args, sync):
    """The AdamW learning rate of a run: --inner-lr for DiLoCo's inner optimizer, --lr for synchronous DP."""
    return args.inner_lr if sync == "diloco" else args.lr


# The synchronous hybrid plans the cluster part runs beside DP=4: run_study.py's on all four workers, and tensor
# parallelism inside each site with DP across them.
HYBRID_PLANS = {name: parallel for name, parallel, _ in PLANS if name != "dp4-across-sites"}
HYBRID_PLANS["dp2xtp2-dp-across"] = (
    "{plan: manual, dp: 2, tp: 2, microbatches: 1, placement: [{replica: 0, stage: 0, tp_rank: 0, site: a}, "
    "{replica: 0, stage: 0, tp_rank: 1, site: a}, {replica: 1, stage: 0, tp_rank: 0, site: b}, "
    "{replica: 1, stage: 0, tp_rank: 1, site: b}]}")


def spec_text(name, data, steps, eval_every, model, sync, inner_steps=0, codec="int8", wan_codec="bf16",
              outer=(0.7, 0.9), fragments=1, lr=STUDY_LR, seed=1, batch=STUDY_BATCH, parallel=None,
              inner_lr_scale=1.0):
    """The study's job. `parallel` (a hybrid plan's parallel block) replaces DP=4 over sites a a b b."""
    parallel = parallel or f"{{plan: manual, dp: 4, microbatches: 1, sync: {sync}, placement: {SITES}}}"
    text = (f"name: {name}\nmodel: {model}\n"
            f"data: {{train: '{data}/train_*.bin', val: '{data}/val_*.bin'}}\n"
            f"train: {{global_batch: {batch}, seq_len: 64, steps: {steps}, lr: {lr:g}, warmup_steps: 10, "
            f"weight_decay: 0.1, grad_clip: 1.0, seed: {seed}, eval_every: {eval_every}, eval_batches: 4, "
            f"precision: fp32}}\n"  # fp32 as train --local runs it: the cluster's emulated RTX 6000s would be fp16
            f"parallel: {parallel}\n"
            f"comm: {{wan_codec: {wan_codec}}}\n")
    if sync == "diloco":
        text += (f"diloco: {{inner_steps: {inner_steps}, outer_lr: {outer[0]:g}, outer_momentum: {outer[1]:g}, "
                 f"codec: {quote_codec(codec)}, fragments: {fragments}"
                 # always given: its default is sqrt(groups) since 2026-12-07, and the recorded runs pin theirs
                 f", inner_lr_scale: {inner_lr_scale:g}}}\n")
    return text


def quote_codec(codec):
    """A codec name in the spec's flow mapping: quoted when it holds a colon (sparse:0.05:4, topk:0.01)."""
    return f"'{codec}'" if ":" in codec else codec


def quality(args, geotrain, data, work):
    """Every run under every seed of --seeds (the weights' initialisation; the tokens stay the same). Prints each
    DiLoCo run's final validation loss against synchronous DP's of the same seed, and the mean over the seeds.
    With --warm-start W the synchronous run (first) checkpoints every W steps and the DiLoCo runs resume from its
    step W; a seed's checkpoints are removed after its runs."""
    rows, final = [], {}
    runs = [("sync-dp", "sync", 0, None)] + [(diloco_name(h, o, args.outer), "diloco", h, o)
                                              for h in args.inner_steps for o in args.outer]
    for seed in args.seeds:
        ckpt = os.path.join(work, f"warm-start-s{seed}")  # --warm-start: the synchronous run's checkpoints
        for name, sync, h, outer in runs:
            path = os.path.join(work, f"{name}-s{seed}.yaml")
            with open(path, "w") as f:
                f.write(spec_text(name, data, args.steps, args.eval_every, args.model, sync, h,
                                  codec=args.quality_codec, outer=outer or (0.7, 0.9),
                                  fragments=args.quality_fragments, lr=run_lr(args, sync), seed=seed,
                                  batch=args.batch, inner_lr_scale=args.inner_lr_scale))
                if args.warm_start and sync == "sync":  # its checkpoints do not change its training
                    f.write(f"checkpoint: {{dir: '{ckpt}', every_steps: {args.warm_start}, keep: -1}}\n")
                elif args.warm_start:
                    f.write(f"checkpoint: {{resume_from: '{ckpt}/step_{args.warm_start:08d}'}}\n")
            out = run([geotrain, "train", "--local", path], os.environ, timeout=7200)
            if args.warm_start and sync != "sync" and f"at step {args.warm_start}\n" not in out:
                raise RuntimeError(f"quality {name} seed {seed}: did not resume from the synchronous run's step "
                                   f"{args.warm_start}:\n{out[-2000:]}")
            for s in local_steps(out):
                if s["val_loss"] is not None:
                    rows.append({"run": name, "seed": seed, "inner_steps": h,
                                 "lr": run_lr(args, sync), "inner_lr_scale": args.inner_lr_scale if h else "",
                                 "warm_start": args.warm_start if h else 0,
                                 "outer_lr": outer[0] if outer else "",
                                 "outer_momentum": outer[1] if outer else "", "step": s["step"],
                                 "train_loss": s["loss"], "val_loss": s["val_loss"]})
            if not rows or (rows[-1]["run"], rows[-1]["seed"]) != (name, seed):
                raise RuntimeError(f"quality {name} seed {seed}: no validation loss in the output of {path}:\n"
                                   f"{out[-2000:]}")
            final[(name, seed)] = rows[-1]["val_loss"]  # its last evaluation
            print(f"quality {name} seed {seed}: final val loss {rows[-1]['val_loss']:.4f} at step "
                  f"{rows[-1]['step']}", flush=True)
        shutil.rmtree(ckpt, ignore_errors=True)
    with open(os.path.join(args.out, f"diloco_quality{quality_suffix(args)}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for name, _, _, _ in runs[1:]:
        gaps = [100 * (final[(name, s)] / final[("sync-dp", s)] - 1) for s in args.seeds]
        print(f"quality {name}: final val loss vs synchronous DP " +
              ", ".join(f"{g:+.2f}% (seed {s})" for g, s in zip(gaps, args.seeds)) +
              f"; mean {statistics.mean(gaps):+.2f}%", flush=True)
    return rows


def diloco_name(h, outer, all_outer):
    """diloco-h8, or diloco-h8-lr1-m0 when several outer optimizers run."""
    return f"diloco-h{h}" + (f"-lr{outer[0]:g}-m{outer[1]:g}" if len(all_outer) > 1 else "")


def cluster(args, geotrain, data, work, env):
    """Each repeat runs every latency in turn (a fresh cluster each), so that the machine's load drifts over all of
    them alike. Each run reports its wall time and WAN bytes per step over steps 2 to N-1 (the first pays the
    start-up; the last, N = --cluster-steps, the validation and DiLoCo's final sync of every fragment) and its
    validation loss at step N (the synchronous plans train the same model: their losses should agree)."""
    baselines = {"sync-dp": ("sync-dp", "sync", 0, None),
                 "diloco": (f"diloco-h{args.cluster_inner_steps}", "diloco", args.cluster_inner_steps, None)}
    runs = [baselines[name] for name in args.baselines]
    runs += [(name, "sync", 0, HYBRID_PLANS[name]) for name in args.hybrids]
    per_run = {}
    for repeat in range(args.repeats):
        for lat in (0.0, args.latency_ms):
            topo = os.path.join(work, f"topo-{lat}.yaml")
            with open(topo, "w") as f:
                f.write("sites:\n  - {name: a, workers: [{device: RTX6000}, {device: RTX6000}]}\n"
                        "  - {name: b, workers: [{device: RTX6000}, {device: RTX6000}]}\n"
                        f"links:\n  - {{a: a, b: b, latency_ms: {lat}, bandwidth_mbps: {args.bandwidth_mbps}, "
                        "jitter_ms: 0}\n")
            run([geotrain, "cluster", "up", topo], env)
            try:
                for name, sync, h, parallel in runs:
                    path = os.path.join(work, f"cluster-{name}-{lat}.yaml")
                    with open(path, "w") as f:
                        f.write(spec_text(name, data, args.cluster_steps, args.cluster_steps, args.model, sync, h,
                                          outer=args.outer[0], fragments=args.cluster_fragments,
                                          lr=run_lr(args, sync), parallel=parallel))
                    out = run([geotrain, "job", "submit", path, "--follow"], env, timeout=3600)
                    steps = cluster_steps(out)
                    if len(steps) != args.cluster_steps or steps[-1]["val_loss"] is None:
                        raise RuntimeError(f"{name} at {lat} ms: expected {args.cluster_steps} steps, the last with a "
                                           f"validation loss:\n{out[-3000:]}")
                    timed = steps[1:-1]
                    r = per_run.setdefault((lat, name), {
                        "latency_ms": lat, "bandwidth_mbps": args.bandwidth_mbps, "run": name, "inner_steps": h,
                        "steps": len(steps), "timed_steps": len(timed), "step_s_mean": [], "step_s_median": [],
                        "wan_bytes_per_step": sum(s["wan_bytes"] for s in timed) / len(timed), "val_loss": []})
                    r["step_s_mean"].append(sum(s["step_s"] for s in timed) / len(timed))
                    r["step_s_median"].append(statistics.median(s["step_s"] for s in timed))
                    r["val_loss"].append(steps[-1]["val_loss"])
                    print(f"cluster repeat {repeat + 1} {lat} ms {name}: {r['step_s_mean'][-1]:.3f} s per step, "
                          f"{r['wan_bytes_per_step'] / 1e6:.2f} MB across sites per step, validation loss "
                          f"{r['val_loss'][-1]:.4f} at step {len(steps)}", flush=True)
            finally:
                subprocess.run([geotrain, "cluster", "down"], env=env, capture_output=True)
    rows = []
    for r in per_run.values():
        r = dict(r, repeats=len(r["step_s_mean"]), step_s_mean_runs=" ".join(f"{x:.3f}" for x in r["step_s_mean"]),
                 val_loss_runs=" ".join(f"{x:.4f}" for x in r["val_loss"]))
        r["step_s_mean"] = statistics.median(r["step_s_mean"])
        r["step_s_median"] = statistics.median(r["step_s_median"])
        r["val_loss"] = statistics.median(r["val_loss"])
        rows.append(r)
    with open(os.path.join(args.out, args.cluster_csv), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for name, _, _, _ in runs:
        at = {r["latency_ms"]: r["step_s_mean"] for r in rows if r["run"] == name}
        print(f"cluster {name}: {at[args.latency_ms]:.3f} s per step at {args.latency_ms:g} ms, {at[0.0]:.3f} s at "
              f"0 ms: {at[args.latency_ms] / at[0.0]:.2f}x (median over {args.repeats} repeats)", flush=True)
    hybrids = [r for r in rows if r["run"] in args.hybrids and r["latency_ms"] == args.latency_ms]
    if hybrids:
        best = min(hybrids, key=lambda r: r["step_s_mean"])
        print(f"cluster: the best synchronous hybrid plan at {args.latency_ms:g} ms is {best['run']} "
              f"({best['step_s_mean']:.3f} s per step, {best['wan_bytes_per_step'] / 1e6:.2f} MB across sites)",
              flush=True)
    return rows


def quality_suffix(args):
    """The quality part's files name what differs from the study's settings (256 steps, batch 16, learning rate
    2e-3 for every run), so that they land beside the study's figures, not over them: --batch 32 writes
    diloco_quality_batch32.csv and diloco_val_loss_batch32.png, --steps 512 diloco_quality_steps512.csv, --lr 3e-3
    diloco_quality_lr0.003.csv, --inner-lr 2.83e-3 diloco_quality_innerlr0.00283.csv, --inner-lr-scale 1.41421
    diloco_quality_innerscale1.41421.csv, --warm-start 32
    diloco_quality_warm32.csv, a 6-layer, 256-channel --model diloco_quality_6x256.csv, and --quality-codec int8
    diloco_quality_int8.csv."""
    differs = [(args.model != STUDY_MODEL, f"_{model_label(args.model)}"),
               (args.steps != STUDY_STEPS, f"_steps{args.steps}"), (args.batch != STUDY_BATCH, f"_batch{args.batch}"),
               (args.lr != STUDY_LR, f"_lr{args.lr:g}"), (args.inner_lr != args.lr, f"_innerlr{args.inner_lr:g}"),
               (args.inner_lr_scale != 1, f"_innerscale{args.inner_lr_scale:g}"),
               (args.warm_start > 0, f"_warm{args.warm_start}"),
               (args.quality_codec != "none", "_" + re.sub(r"[^\w.]+", "_", args.quality_codec))]
    return "".join(name for differ, name in differs if differ)


def model_label(model):
    """A --model in a file name: LAYERSxCHANNELS ("6x256") with n_layer and n_embd and nothing else but n_head,
    block_size and vocab_size; else its preset and fields ("gpt2-demo-n_layer6"); else its characters."""
    fields = dict(re.findall(r"\b(\w+)\b['\"]?\s*:\s*['\"]?([\w.-]+)", model))
    if {"n_layer", "n_embd"} <= set(fields) <= {"n_layer", "n_embd", "n_head", "block_size", "vocab_size"}:
        return f"{fields['n_layer']}x{fields['n_embd']}"
    if fields:
        preset = [fields.pop("preset")] if "preset" in fields else []
        return "-".join(preset + [f"{k}{v}" for k, v in fields.items()])
    return re.sub(r"[^\w.-]+", "_", model).strip("_") or "model"


def plot(rows, out, suffix=""):
    """Validation loss per run: the mean over the seeds at each evaluated step; a warm-started run from the
    synchronous run's point at its step W (marked)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seeds = sorted({r["seed"] for r in rows})
    plt.figure(figsize=(7, 4))
    for name in dict.fromkeys(r["run"] for r in rows):
        steps = sorted({r["step"] for r in rows if r["run"] == name})
        warm = max(r.get("warm_start", 0) for r in rows if r["run"] == name)
        if warm and any(r["run"] == "sync-dp" and r["step"] == warm for r in rows):
            steps = [warm] + steps  # it starts from the synchronous run's weights at step W
        mean = [statistics.mean(r["val_loss"] for r in rows
                                if r["run"] == (name if step > warm else "sync-dp") and r["step"] == step)
                for step in steps]
        own = sorted({r["seed"] for r in rows if r["run"] == name})
        note = f" (mean of {len(own)} seeds)" if len(own) > 1 else f" (seed {own[0]})"
        plt.plot(steps, mean, marker=".", label=name + (note if len(seeds) > 1 else "") +
                 (f", synchronous until step {warm}" if warm else ""))
        if warm:
            plt.axvline(warm, color="grey", linestyle=":", linewidth=1)
    plt.xlabel("step")
    plt.ylabel("validation loss")
    plt.title("4 replicas in 2 sites: synchronous DP vs DiLoCo (same tokens)", fontsize=10)
    plt.grid(alpha=0.3)
    plt.legend(fontsize=8)
    plt.tight_layout()
    plt.savefig(os.path.join(out, f"diloco_val_loss{suffix}.png"), dpi=120)
    plt.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geotrain", default="build/bin/geotrain")
    ap.add_argument("--out", default="docs/results/data/geo")
    ap.add_argument("--data", default="fortunes",
                    help="fortunes (default), synthetic, or a directory of train_*.bin and val_*.bin")
    ap.add_argument("--model", default=STUDY_MODEL,
                    help="the model block (YAML); other than the study's: files named _PRESET or _LAYERSxCHANNELS")
    ap.add_argument("--steps", type=int, default=STUDY_STEPS)
    ap.add_argument("--eval-every", type=int, default=32)
    ap.add_argument("--inner-steps", default="8,32,128")
    ap.add_argument("--outer", default="1.0:0,0.7:0.9", help="outer optimizers LR:MOMENTUM (Nesterov), comma-separated")
    ap.add_argument("--quality-fragments", type=int, default=1, help="DiLoCo fragments of the quality runs")
    ap.add_argument("--quality-codec", default="none",
                    help="the quality runs' diloco.codec, which train --local applies to the pseudo-gradients as "
                         "the cluster does (none: exact, the study's figures); other than none: files named _CODEC")
    ap.add_argument("--seeds", default="1", help="initialisation seeds of the quality runs, comma-separated")
    ap.add_argument("--lr", type=float, default=STUDY_LR, help="synchronous (and inner) AdamW learning rate")
    ap.add_argument("--inner-lr", type=float, default=None,
                    help="the DiLoCo runs' inner AdamW learning rate (default: --lr); other than --lr: files "
                         "named _innerlrX")
    ap.add_argument("--inner-lr-scale", type=float, default=1.0,
                    help="quality: the DiLoCo runs' diloco.inner_lr_scale: their inner rate is the schedule's times "
                         "this, capped at the peak (1.41421 = sqrt(2 sites)); other than 1: files named _innerscaleX "
                         "(the cluster part, which measures time and bytes, keeps 1)")
    ap.add_argument("--batch", type=int, default=STUDY_BATCH,
                    help="global batch of the quality runs (sequences of 64 tokens); other than 16: files "
                         "named _batchN")
    ap.add_argument("--warm-start", type=int, default=0,
                    help="quality: the DiLoCo runs start from the synchronous run's checkpoint at this step "
                         "(its first steps synchronous across sites); files named _warmN")
    ap.add_argument("--parts", default="quality,cluster")
    ap.add_argument("--latency-ms", type=float, default=100)
    ap.add_argument("--bandwidth-mbps", type=float, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster-steps", type=int, default=34,
                    help="steps of each cluster run: steps 2 to N-1 are timed, the last is evaluated")
    ap.add_argument("--baselines", default="sync-dp,diloco",
                    help="the cluster part's DP=4 and DiLoCo runs (comma-separated; empty for none)")
    ap.add_argument("--cluster-csv", default="diloco_cluster.csv", help="the cluster part's CSV, in --out")
    ap.add_argument("--hybrids", default=",".join(HYBRID_PLANS),
                    help="synchronous hybrid plans the cluster part runs beside DP=4 and DiLoCo (comma-separated, "
                         f"of {', '.join(HYBRID_PLANS)}; empty for none)")
    ap.add_argument("--cluster-inner-steps", type=int, default=8)
    codecs_study.add_arguments(ap)
    ap.add_argument("--cluster-fragments", type=int, default=4)
    args = ap.parse_args()
    args.inner_steps = [int(x) for x in args.inner_steps.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.hybrids = list(dict.fromkeys(x for x in args.hybrids.split(",") if x))  # each plan once
    unknown = [x for x in args.hybrids if x not in HYBRID_PLANS]
    if unknown:
        ap.error(f"--hybrids: unknown plan {', '.join(unknown)}; known: {', '.join(HYBRID_PLANS)}")
    args.baselines = list(dict.fromkeys(x for x in args.baselines.split(",") if x))
    if [x for x in args.baselines if x not in ("sync-dp", "diloco")]:
        ap.error(f"--baselines {','.join(args.baselines)}: known runs are sync-dp and diloco")
    if not args.baselines and not args.hybrids:
        ap.error("--baselines and --hybrids are both empty: the cluster part would run nothing")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} must be at least 1")
    if args.cluster_steps < 3:
        ap.error(f"--cluster-steps {args.cluster_steps} must be at least 3 (the first and the last are not timed)")
    if args.inner_lr is None:
        args.inner_lr = args.lr
    if args.lr <= 0 or args.inner_lr <= 0:
        ap.error(f"--lr {args.lr:g} and --inner-lr {args.inner_lr:g} must be positive (the study's: {STUDY_LR:g})")
    if not 0 < args.inner_lr_scale <= 10:
        ap.error(f"--inner-lr-scale {args.inner_lr_scale:g} must be in (0, 10] (1: the schedule as it is)")
    if not 0 <= args.warm_start < args.steps:
        ap.error(f"--warm-start {args.warm_start} must be 0 (off) or a step below --steps ({args.steps})")
    args.outer = [tuple(float(v) for v in o.split(":")) for o in args.outer.split(",")]
    geotrain = os.path.abspath(args.geotrain)
    os.makedirs(args.out, exist_ok=True)
    work, env = private_cluster_env("geotrain_diloco_")
    try:
        data = os.path.abspath(args.data) if args.data not in ("fortunes", "synthetic") else os.path.join(work, "data")
        if args.data == "fortunes":
            run([geotrain, "data", "prepare", "/usr/share/games/fortunes", "--out", data, "--val-fraction", "0.01"],
                env)
        elif args.data == "synthetic":
            os.makedirs(data)
            write_pattern_shard(os.path.join(data, "train_000000.bin"), 400000, 512, seed=3)
            write_pattern_shard(os.path.join(data, "val_000000.bin"), 20000, 512, seed=3)
            if args.model == STUDY_MODEL:
                args.model = "{n_layer: 4, n_head: 4, n_embd: 128, block_size: 64, vocab_size: 512}"
        parts = args.parts.split(",")
        if "quality" in parts:
            plot(quality(args, geotrain, data, work), args.out, quality_suffix(args))
        if "cluster" in parts:
            cluster(args, geotrain, data, work, env)
        if "codec-bytes" in parts:
            codecs_study.measure_bytes(args, geotrain, data, work, env, spec_text)
        if "codecs" in parts:
            codecs_study.quality_grid(args, geotrain, data, work, spec_text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
