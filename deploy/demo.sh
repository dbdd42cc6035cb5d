#!/usr/bin/env bash
# `make demo`: the main job. Brings up two sites 30 ms apart on this machine (a head, the WAN emulator
# and four workers with emulated RTX 6000s), trains a small GPT-2 on the Debian fortunes corpus with a
# DP x PP plan (each replica's pipeline spans both sites; gradients are all-reduced inside each site;
# what crosses the WAN goes in bf16), shows progress, writes a checkpoint, prints a summary and the path
# of a PNG loss plot, and tears everything down (also on Ctrl-C or an error).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
geotrain="$root/build/bin/geotrain"
[ -x "$geotrain" ] || { echo "demo: $geotrain is missing; run 'make build' first" >&2; exit 1; }
out="$root/build/demo"
mkdir -p "$out"
work="$(mktemp -d /tmp/geotrain-demo.XXXXXX)"
export GEOTRAIN_HOME="$work/home"   # keeps the demo's cluster apart from any real one
unset GEOTRAIN_HEAD GEOTRAIN_TOKEN
cleanup() {
  "$geotrain" cluster down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
start=$(date +%s)

if [ ! -f "$out/data/train_000000.bin" ]; then
  echo "== tokenizing the fortunes corpus (GPT-2 BPE) into $out/data"
  "$geotrain" data prepare /usr/share/games/fortunes --out "$out/data" --val-fraction 0.01
fi

echo "== bringing up two sites 30 ms apart (deploy/topologies/two-sites-30ms.yaml)"
"$geotrain" cluster up "$root/deploy/topologies/two-sites-30ms.yaml"
echo
"$geotrain" status
echo

rm -rf "$out/ckpt"
cat >"$out/demo-job.yaml" <<SPEC
name: fortunes-demo
model: {preset: gpt2-demo}
data: {train: $out/data/train_*.bin, val: $out/data/val_*.bin}
train: {global_batch: 16, seq_len: 64, steps: 40, lr: 2.0e-3, warmup_steps: 5, weight_decay: 0.1, grad_clip: 1.0, seed: 1, eval_every: 10}
parallel:
  plan: manual
  dp: 2
  pp: 2
  microbatches: 2
  schedule: 1f1b
  placement:
    - {replica: 0, stage: 0, site: site-a}
    - {replica: 1, stage: 0, site: site-a}
    - {replica: 0, stage: 1, site: site-b}
    - {replica: 1, stage: 1, site: site-b}
comm: {wan_codec: bf16}
checkpoint: {dir: $out/ckpt, every_steps: 20}
SPEC
echo "== training (spec: $out/demo-job.yaml)"
"$geotrain" job submit "$out/demo-job.yaml" --follow --progress | tee "$out/demo-job.log"
job_id=$(sed -n 's/^submitted \(job-[0-9]*\).*/\1/p' "$out/demo-job.log")
"$geotrain" job logs "$job_id" >"$out/demo-events.log"
echo
echo "== links as configured and as measured, and what crossed the emulated WAN"
"$geotrain" cluster status
"$geotrain" cluster down

/usr/bin/python3 - "$out/demo-events.log" "$out/loss.png" <<'PY'
import re, sys
steps, losses, tokens, wan, val_steps, val = [], [], [], 0, [], []
for line in open(sys.argv[1]):
    m = re.search(r"step (\d+) loss ([0-9.]+) ([0-9.]+) tokens/s .* wan bytes (\d+)", line)
    if m:
        steps.append(int(m.group(1))); losses.append(float(m.group(2)))
        tokens.append(float(m.group(3))); wan += int(m.group(4))
        v = re.search(r"val_loss ([0-9.]+)", line)
        if v:
            val_steps.append(int(m.group(1))); val.append(float(v.group(1)))
if not steps:
    sys.exit("demo: no steps in the job's log")
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
plt.figure(figsize=(6, 3.5))
plt.plot(steps, losses, marker=".", label="training")
if val:
    plt.plot(val_steps, val, marker="o", label="validation (mean over replicas)")
plt.legend()
plt.xlabel("step"); plt.ylabel("loss"); plt.title("geotrain demo: gpt2-demo on fortunes, DP2 x PP2, 2 sites", fontsize=10)
plt.grid(alpha=0.3); plt.tight_layout(); plt.savefig(sys.argv[2], dpi=120)
tokens.sort()
print(f"\nsummary: {len(steps)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
      + (f", val loss {val[-1]:.3f}" if val else "") + ", "
      f"median {tokens[len(tokens)//2]:.0f} tokens/s, {wan/1e6:.1f} MB across the WAN (bf16)")
print(f"loss plot: {sys.argv[2]}")
PY
latest="$out/ckpt/$(cat "$out/ckpt/latest")"
echo "checkpoint: $latest (manifest.json lists every stage's file; loads in train --local and in HF transformers)"
echo "demo finished in $(( $(date +%s) - start )) s"
