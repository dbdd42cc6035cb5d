#!/usr/bin/python3
"""Plots train and validation loss from the output of `geotrain train --local` (lines
`step N/M | loss X | val Y | ...`). Usage: plot_loss.py LOG OUT.png"""
import re
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main():
    log, out = sys.argv[1], sys.argv[2]
    steps, losses, val_steps, vals = [], [], [], []
    with open(log, errors="replace") as f:
        for line in f.read().replace("\r", "\n").splitlines():
            m = re.search(r"step (\d+)/\d+ \| loss ([0-9.]+)(?: \| val ([0-9.]+))?", line)
            if not m:
                continue
            steps.append(int(m.group(1)))
            losses.append(float(m.group(2)))
            if m.group(3):
                val_steps.append(int(m.group(1)))
                vals.append(float(m.group(3)))
    plt.figure(figsize=(7, 4))
    plt.plot(steps, losses, label="train loss", linewidth=0.8)
    plt.plot(val_steps, vals, "o-", label="val loss")
    plt.xlabel("step")
    plt.ylabel("cross-entropy (nats)")
    plt.title("geotrain train --local: gpt2-demo on fortunes (CPU)")
    plt.grid(alpha=0.3)
    plt.legend()
    plt.tight_layout()
    plt.savefig(out, dpi=100)
    print(f"{len(steps)} steps; last train loss {losses[-1]:.3f}; last val loss {vals[-1] if vals else float('nan'):.3f}")


if __name__ == "__main__":
    main()
