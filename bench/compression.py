"""Gradient compression of the DP sync: bytes per step saved and what it costs in the loss
curve, for float16, bfloat16 and top-k (with error feedback) against the dense sync.

The runs are bench/dp_scaling.py's ``--curves`` mode (same model, data, seed; dp=2; the
launcher and the worker live there); this script adds the figure and the ratios.

    python bench/compression.py --curve-steps 60 --json bench/results/compression.json --png docs/img/compression.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import dp_scaling  # noqa: E402


def run(steps: int, topk: float, timeout: float) -> dict:
    a = dp_scaling.parse(["--launch", "--curves", "--curve-steps", str(steps), "--topk", str(topk),
                          "--timeout", str(timeout)])
    res = dp_scaling.launch_curves(a)          # prints its table; adds last10 and bytes_ratio
    dense = res["results"][0]
    for r in res["results"]:
        r["bytes_saved"] = 1.0 - r["bytes_ratio"]
        r["loss_cost"] = r["last10"] - dense["last10"]
    return dict(res, machine=common.machine(), dp=2, preset="tiny")


def plot(res: dict, png) -> None:
    plt = common.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    rs = res["results"]
    ax.bar(range(len(rs)), [r["bytes_ratio"] for r in rs], color="tab:orange")
    ax.set_xticks(range(len(rs)), [r["compress"] for r in rs])
    for i, r in enumerate(rs):
        ax.text(i, r["bytes_ratio"], f"{r['bytes_ratio']:.3f}x\n{r['bytes_sent'] / 1024:.0f} KB", ha="center",
                va="bottom", fontsize=7)
    ax.set(ylabel="bytes sent per step / dense", ylim=(0, 1.3), title="wire bytes per step, ratio to dense")
    k = 5
    for r in rs:
        loss = np.convolve(r["losses"], np.ones(k) / k, mode="valid")
        ax2.plot(np.arange(len(loss)) + k - 1, loss, label=f"{r['compress']}: {r['loss_cost']:+.3f}")
    ax2.set(xlabel="step", ylabel=f"training loss (mean of {k} steps)",
            title="loss curve; legend: last-10 loss minus dense")
    ax2.legend(fontsize=7)
    fig.suptitle(f"Compressed DP sync, dp=2, preset tiny, {res['steps']} AdamW steps ({common.machine()})", fontsize=8)
    common.save(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curve-steps", type=int, default=60)
    ap.add_argument("--topk", type=float, default=0.01, help="top-k ratio (also runs 10x it)")
    ap.add_argument("--timeout", type=float, default=900)
    common.run_and_write(ap, argv, "compression", lambda a: run(a.curve_steps, a.topk, a.timeout), plot)


if __name__ == "__main__":
    main()
