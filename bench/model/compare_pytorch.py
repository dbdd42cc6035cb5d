#!/usr/bin/python3
"""Training tokens/s of geotrain's CPU GPT-2 next to the same model in PyTorch, side by side.

For each shape, runs A B A B ... (ours: build/bin/train_step_bench; reference: this script's PyTorch
GPT-2 in a subprocess), both with the same thread count, and prints the medians, the ratio, and the
achieved GFLOP/s (6N + 6LCT FLOPs per token) against this CPU's fp32 peak.

  /usr/bin/python3 bench/model/compare_pytorch.py --bench build/bin/train_step_bench --threads 2 --reps 3
"""
import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time

SHAPES = {
    # name: (n_layer, n_head, n_embd, vocab, B, T)
    "gpt2-124M": (12, 12, 768, 50257, 4, 256),
    "small": (4, 4, 256, 50257, 8, 128),
}


def torch_worker(L, NH, C, V, B, T, steps, warmup, threads):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    torch.manual_seed(1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C)
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            self.ln_2 = nn.LayerNorm(C)
            self.c_fc = nn.Linear(C, 4 * C)
            self.mlp_proj = nn.Linear(4 * C, C)
            self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)))

        def forward(self, x):
            Bx, Tx, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(Bx, Tx, NH, C // NH).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // NH))
            att = att.masked_fill(~self.mask[:Tx, :Tx], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(Bx, Tx, C)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.h = nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = nn.LayerNorm(C)
            self.lm_head = nn.Linear(C, V, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95))
    x = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, T))
    rates = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        s = time.perf_counter() - t0
        print(f"step {step} loss {loss.item():.4f} time {s:.3f} s tokens/s {B * T / s:.1f}", flush=True)
        if step >= warmup:
            rates.append(B * T / s)
    rates.sort()
    print(f"tokens_per_s {rates[len(rates) // 2]:.2f}")


def run(cmd, env):
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    m = re.search(r"tokens_per_s ([0-9.]+)", out)
    return float(m.group(1))


def cpu_peak_gflops(threads):
    mhz, model = 0.0, "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz") and not mhz:
                mhz = float(line.split(":")[1])
            if line.startswith("model name") and model == "unknown":
                model = line.split(":")[1].strip()
    # docs/measuring convention: an AVX-512 core with two 512-bit FMA pipes does 64 fp32 FLOP per cycle.
    return threads * 64 * mhz / 1e3, model, mhz


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", default="build/bin/train_step_bench")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--torch-worker", nargs=8, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker:
        torch_worker(*args.torch_worker, args.threads)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads))
    peak, cpu, mhz = cpu_peak_gflops(args.threads)
    print(f"cpu: {cpu} at {mhz:.0f} MHz; {args.threads} threads; fp32 peak {peak:.0f} GFLOP/s (64 FLOP/cycle/core)")
    summary = []
    for name in args.shapes.split(","):
        L, NH, C, V, B, T = SHAPES[name]
        n_params = (V + 127) // 128 * 128 * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
        flops_per_token = 6 * n_params + 6 * L * C * T
        ours_cmd = [args.bench, "--n_layer", str(L), "--n_head", str(NH), "--n_embd", str(C), "--vocab", str(V),
                    "--batch", str(B), "--seq", str(T), "--steps", str(args.steps), "--warmup", "1"]
        torch_cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(args.threads), "--torch-worker",
                     str(L), str(NH), str(C), str(V), str(B), str(T), str(args.steps), "1"]
        ours, ref = [], []
        for rep in range(args.reps):
            ours.append(run(ours_cmd, env))
            ref.append(run(torch_cmd, env))
            print(f"{name} rep {rep}: geotrain {ours[-1]:.1f} tok/s, pytorch {ref[-1]:.1f} tok/s", flush=True)
        o, r = statistics.median(ours), statistics.median(ref)
        # Ratio of medians, and the median of the side-by-side pairs' ratios (robust to load drifting).
        pair_ratio = statistics.median(a / b for a, b in zip(ours, ref))
        gflops = o * flops_per_token / 1e9
        summary.append((name, B, T, o, r, o / r, pair_ratio, gflops, gflops / peak))
    print()
    print(f"{'shape':<10} {'B':>2} {'T':>4} {'geotrain tok/s':>15} {'pytorch tok/s':>14} {'ratio':>6} "
          f"{'pair ratio':>10} {'GFLOP/s':>8} {'of peak':>8}")
    for name, B, T, o, r, ratio, pair_ratio, gflops, frac in summary:
        print(f"{name:<10} {B:>2} {T:>4} {o:>15.1f} {r:>14.1f} {ratio:>6.2f} {pair_ratio:>10.2f} {gflops:>8.1f} "
              f"{frac * 100:>7.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
