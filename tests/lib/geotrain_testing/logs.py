"""The step lines geotrain prints, parsed.

A cluster job's step line (head/job_runner.cc, RecordStep; in `job logs` and `job submit --follow`):
  step N loss L T tokens/s step S s (compute C, comm wait W, bubble B[, checkpoint K][, outer sync O]
      [, inner steps I][, EMULATED slowdown Fx]) wan bytes X [(PAIR BYTES ...)] [val_loss V]
where a job on timed compute says `EMULATED (timed compute) loss n/a` for `loss L`. DiLoCo steps with an outer step
give its blocking time O; time-paced ones the most inner steps a group took (I, when more than one); a step on a
worker slowed by --slowdown says so (its times are emulated).
`geotrain train --local`'s (model/trainer.cc): step N/M | loss L [| val V] [| ...].
"""
import re

CLUSTER_STEP = re.compile(
    r"step (?P<step>\d+) (?:(?P<emulated>EMULATED \(timed compute\) loss n/a)|loss (?P<loss>[0-9.]+)) "
    r"(?P<tokens_per_s>[0-9.]+) tokens/s step (?P<step_s>[0-9.]+) s \(compute (?P<compute_s>[0-9.]+), "
    r"comm wait (?P<comm_wait_s>[0-9.]+), bubble (?P<bubble_s>[0-9.]+)(?:, checkpoint (?P<checkpoint_s>[0-9.]+))?"
    r"(?:, outer sync (?P<outer_sync_s>[0-9.]+))?(?:, inner steps (?P<inner_steps>\d+))?"
    r"(?:, EMULATED slowdown (?P<slowdown>[0-9.]+)x)?[^)]*\) wan bytes (?P<wan_bytes>\d+)(?: \((?P<wan_pairs>[^)]*)\))?[^\n]*?(?: val_loss (?P<val_loss>[0-9.]+))?$",
    re.MULTILINE)

LOCAL_STEP = re.compile(r"step (?P<step>\d+)/(?P<steps>\d+) \| loss (?P<loss>[0-9.]+)(?: \| val (?P<val_loss>[0-9.]+))?"
                        r"(?P<rest>[^\n]*)")


def _number(text, kind=float):
    return None if text is None else kind(text)


def cluster_steps(text):
    """The cluster step lines in `text`, in order, as dicts: step, emulated (bool), loss (None when emulated),
    tokens_per_s, step_s, compute_s, comm_wait_s, bubble_s, checkpoint_s (None without a checkpoint), outer_sync_s
    (None without an outer step), inner_steps (1 unless time-paced), slowdown (1 unless slowed), wan_bytes, wan_pairs
    ({"site-a>site-b": bytes, ...}) and val_loss (None on a step that was not evaluated)."""
    steps = []
    for m in CLUSTER_STEP.finditer(text):
        pairs = re.findall(r"(\S+) (\d+)", m.group("wan_pairs") or "")
        steps.append({"step": int(m.group("step")), "emulated": m.group("emulated") is not None,
                      "loss": _number(m.group("loss")), "tokens_per_s": float(m.group("tokens_per_s")),
                      "step_s": float(m.group("step_s")), "compute_s": float(m.group("compute_s")),
                      "comm_wait_s": float(m.group("comm_wait_s")), "bubble_s": float(m.group("bubble_s")),
                      "checkpoint_s": _number(m.group("checkpoint_s")),
                      "outer_sync_s": _number(m.group("outer_sync_s")),
                      "inner_steps": _number(m.group("inner_steps"), int) or 1,
                      "slowdown": _number(m.group("slowdown")) or 1.0, "wan_bytes": int(m.group("wan_bytes")),
                      "wan_pairs": {pair: int(n) for pair, n in pairs}, "val_loss": _number(m.group("val_loss"))})
    return steps


def local_steps(text):
    """The `train --local` step lines in `text`, in order, as dicts: step, steps (of the run), loss, val_loss (None
    on a step that was not evaluated) and skipped (the step overflowed in fp16 and was skipped)."""
    return [{"step": int(m.group("step")), "steps": int(m.group("steps")), "loss": float(m.group("loss")),
             "val_loss": _number(m.group("val_loss")), "skipped": "(overflow: skipped)" in m.group("rest")}
            for m in LOCAL_STEP.finditer(text)]
