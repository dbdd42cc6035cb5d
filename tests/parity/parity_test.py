#!/usr/bin/python3
"""Parity of geotrain's CPU GPT-2 with PyTorch.

For each configuration: `geotrain model init` writes weights, a random token shard is written in the
llm.c .bin layout, `geotrain model grad` gives logits, loss and every gradient, and `geotrain model steps`
gives the losses and parameters after 10 AdamW steps with clipping and the warm-up + cosine schedule.
The same model is built in PyTorch (float64, from the same safetensors weights and tokens) and every
tensor must agree: max |ours - ref| <= 1e-4 * max(1, max |ref|).

Usage: parity_test.py --geotrain build/bin/geotrain
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

from geotrain_testing.checkpoints import read_safetensors
from geotrain_testing.shards import write_token_shard

TOLERANCE = 1e-4

CONFIGS = [
    # name, n_layer, n_head, n_embd, vocab, block_size, B, T
    ("awkward", 2, 3, 48, 97, 24, 3, 17),
    ("real-vocab", 2, 2, 32, 50257, 16, 2, 16),
    ("wider", 3, 4, 128, 512, 64, 2, 64),
]
STEPS = 10


def forward(p, idx, targets, L, NH):
    """GPT-2 in PyTorch on HF-named tensors (Conv1D layout: y = x @ W + b)."""
    B, T = idx.shape
    C = p["wte.weight"].shape[1]
    x = p["wte.weight"][idx] + p["wpe.weight"][:T]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(L):
        h = F.layer_norm(x, (C,), p[f"h.{l}.ln_1.weight"], p[f"h.{l}.ln_1.bias"], eps=1e-5)
        qkv = h @ p[f"h.{l}.attn.c_attn.weight"] + p[f"h.{l}.attn.c_attn.bias"]
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // NH)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[f"h.{l}.attn.c_proj.weight"] + p[f"h.{l}.attn.c_proj.bias"]
        h = F.layer_norm(x, (C,), p[f"h.{l}.ln_2.weight"], p[f"h.{l}.ln_2.bias"], eps=1e-5)
        h = F.gelu(h @ p[f"h.{l}.mlp.c_fc.weight"] + p[f"h.{l}.mlp.c_fc.bias"], approximate="tanh")
        x = x + h @ p[f"h.{l}.mlp.c_proj.weight"] + p[f"h.{l}.mlp.c_proj.bias"]
    x = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
    logits = x @ p["wte.weight"].T
    loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))
    return logits, loss


def lr_at(step, max_lr, min_lr, warmup, total):
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    ratio = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


class Checker:
    def __init__(self):
        self.failures = []
        self.worst = {}

    def check(self, what, ours, ref):
        ours = np.asarray(ours, dtype=np.float64)
        ref = np.asarray(ref, dtype=np.float64)
        if ours.shape != ref.shape:
            self.failures.append(f"{what}: shape {ours.shape} vs reference {ref.shape}")
            return
        scale = max(1.0, float(np.abs(ref).max()) if ref.size else 1.0)
        diff = float(np.abs(ours - ref).max()) if ref.size else 0.0
        kind = what.split(":")[0]
        self.worst[kind] = max(self.worst.get(kind, 0.0), diff / scale)
        if not diff <= TOLERANCE * scale:
            self.failures.append(f"{what}: max abs diff {diff:.3e} > {TOLERANCE:.0e} x {scale:.3g}")


def run_config(geotrain, workdir, cfg, checker):
    name, L, NH, C, V, block, B, T = cfg
    lr, warmup, wd, clip = 1e-3, 3, 0.1, 0.5
    spec = os.path.join(workdir, f"{name}.yaml")
    with open(spec, "w") as f:
        f.write(f"name: parity-{name}\n"
                f"model: {{n_layer: {L}, n_head: {NH}, n_embd: {C}, block_size: {block}, vocab_size: {V}}}\n"
                f"train: {{global_batch: {B}, seq_len: {T}, steps: {STEPS}, lr: {lr}, min_lr: {lr / 10}, "
                f"warmup_steps: {warmup}, weight_decay: {wd}, grad_clip: {clip}, beta1: 0.9, beta2: 0.95, seed: 42}}\n")
    weights = os.path.join(workdir, f"{name}.weights.safetensors")
    tokens_path = os.path.join(workdir, f"{name}.bin")
    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, V, size=STEPS * B * T + 1)
    write_token_shard(tokens_path, tokens)
    run = lambda *args: subprocess.run([geotrain, *args], check=True, capture_output=True, text=True)
    run("model", "init", "--config", spec, "--out", weights)
    grads_path = os.path.join(workdir, f"{name}.grads.safetensors")
    run("model", "grad", "--config", spec, "--weights", weights, "--tokens", tokens_path, "--out", grads_path)
    steps_path = os.path.join(workdir, f"{name}.steps.safetensors")
    run("model", "steps", "--config", spec, "--weights", weights, "--tokens", tokens_path, "--out", steps_path)

    w = read_safetensors(weights)
    ours = read_safetensors(grads_path)
    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}
    window = lambda step: np.stack([tokens[(step * B + b) * T:(step * B + b) * T + T + 1] for b in range(B)])
    batch = torch.tensor(window(0), dtype=torch.long)
    logits, loss = forward(params, batch[:, :-1], batch[:, 1:], L, NH)
    loss.backward()
    checker.check(f"logits: {name}", ours["logits"], logits.detach().numpy())
    checker.check(f"loss: {name}", ours["loss"], loss.item())
    for k, p in params.items():
        checker.check(f"grad: {name} {k}", ours[f"grad.{k}"], p.grad.numpy())
    missing = set(params) - {k[len("grad."):] for k in ours if k.startswith("grad.")}
    if missing:
        checker.failures.append(f"{name}: no gradient for {sorted(missing)}")

    # 10 AdamW steps with clipping and the schedule, in PyTorch.
    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}
    decay = [p for k, p in params.items() if p.dim() >= 2]
    no_decay = [p for k, p in params.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step in range(STEPS):
        batch = torch.tensor(window(step), dtype=torch.long)
        opt.zero_grad()
        _, loss = forward(params, batch[:, :-1], batch[:, 1:], L, NH)
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, lr / 10, warmup, STEPS)
        opt.step()
    stepped = read_safetensors(steps_path)
    checker.check(f"losses: {name}", stepped["losses"], np.array(losses))
    for k, p in params.items():
        checker.check(f"params after {STEPS} steps: {name} {k}", stepped[k], p.detach().numpy())
    print(f"{name}: L={L} NH={NH} C={C} V={V} B={B} T={T}: loss {ours['loss']:.6f} vs {losses[0]:.6f}; "
          f"after {STEPS} steps {stepped['losses'][-1]:.6f} vs {losses[-1]:.6f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--geotrain", required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    checker = Checker()
    with tempfile.TemporaryDirectory(prefix="geotrain_parity_") as workdir:
        for cfg in CONFIGS:
            run_config(args.geotrain, workdir, cfg, checker)
    print("worst max|diff| / max(1, max|ref|) by kind (tolerance %.0e):" % TOLERANCE)
    for kind, value in sorted(checker.worst.items()):
        print(f"  {kind:<28} {value:.2e}")
    if checker.failures:
        print(f"{len(checker.failures)} tensors outside the tolerance:")
        for f in checker.failures[:40]:
            print("  " + f)
        return 1
    print("parity: all tensors within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
