"""Figures of the benchmarks that write JSON only (kernels, train_step, pipeline, dp_scaling);
the other bench scripts draw their own. Used by bench/run_all.py.

    python bench/figures.py kernels bench/results/kernels.json docs/img/kernels.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def kernels(d: dict, png) -> None:
    plt = common.pyplot()
    rows = d["results"]
    sizes = sorted({r["elements"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.6), squeeze=False)
    for ax, n in zip(axes[0], sizes):
        rs = [r for r in rows if r["elements"] == n]
        th = sorted(rs[0]["native"], key=int)
        w = 0.8 / len(th)
        for j, t in enumerate(th):
            ax.barh([i + j * w for i in range(len(rs))], [r["native"][t]["speedup"] for r in rs], height=w, label=f"{t} thread(s)")
        ax.set_yticks([i + 0.4 - w / 2 for i in range(len(rs))], [r["kernel"] for r in rs], fontsize=6)
        ax.axvline(1.0, color="k", lw=0.6)
        ax.set(xscale="log", xlabel="speed-up over NumPy (t_numpy / t_native)", title=f"{n:,} elements")
        ax.legend(fontsize=6)
    fig.suptitle(f"C++ kernels ({d.get('isa', '?')}) vs the NumPy reference, {d.get('dtype')} ({common.machine()})", fontsize=8)
    common.save(fig, png)


def train_step(d, png) -> None:
    """pympar's step speed over each PyTorch peer's, one group of bars per shape and thread count."""
    plt = common.pyplot()
    table = d.get("table", {}) if isinstance(d, dict) else {}
    rows = sorted(table.items())
    peers = [("sdpa", "torch eager + SDPA", "tab:blue"), ("compile", "torch.compile + SDPA", "tab:orange"),
             ("naive", "torch eager, naive attention", "tab:gray")]
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.55 * max(1, len(rows))))
    h = 0.8 / len(peers)
    for j, (p, label, c) in enumerate(peers):
        ys = [i + (j - 1) * h for i, (_, r) in enumerate(rows) if f"{p}_speed_ratio" in r]
        vs = [r[f"{p}_speed_ratio"] for _, r in rows if f"{p}_speed_ratio" in r]
        ax.barh(ys, vs, height=h, color=c, label=label)
        for y, v in zip(ys, vs):
            ax.text(v, y, f" {v:.2f}x", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)), [f"{k.split('/')[0]}, {k.split('/')[1]} thr" + (", bf16 vs autocast" if k.endswith("/bf16")
                                                                                    else "") for k, _ in rows], fontsize=6)
    ax.axvline(1.0, color="k", lw=0.6)
    ax.set(xlabel="step speed pympar / PyTorch (same model, weights, threads; > 1: pympar faster)",
           title="training step (fwd + bwd + AdamW), single process")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(common.machine(), fontsize=7)
    fig.tight_layout()
    common.save(fig, png)


def pipeline(d: dict, png) -> None:
    plt = common.pyplot()
    rows = d["rows"]
    ps = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(1, len(ps), figsize=(4.2 * len(ps), 3.2), squeeze=False)
    for ax, p in zip(axes[0], ps):
        for sched, c in (("gpipe", "tab:blue"), ("1f1b", "tab:orange"), ("interleaved", "tab:green")):
            rs = sorted((r for r in rows if r["p"] == p and r["schedule"] == sched), key=lambda r: r["m"])
            if not rs:
                continue
            ax.plot([r["m"] for r in rs], [r["bubble_mean"] for r in rs], "o-", color=c, label=f"{sched} measured")
            ax.plot([r["m"] for r in rs], [r["formula"] for r in rs], ":", color=c, label=f"{sched} formula")
        ax.axvline(4 * p, color="gray", lw=0.6, ls="--")
        ax.text(4 * p, ax.get_ylim()[1] * 0.9, " m = 4p", fontsize=7)
        ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble fraction", title=f"p = {p} stages")
        ax.legend(fontsize=6)
    fig.suptitle(f"pipeline bubble vs micro-batches, measured vs (p-1)/(m+p-1) [(p-1)/(vm+p-1) interleaved], "
                 f"work={d['meta'].get('work')} ({common.machine()})", fontsize=7)
    common.save(fig, png)


def dp_scaling(d: dict, png) -> None:
    plt = common.pyplot()
    rs = d["results"]
    fig, ax = plt.subplots(figsize=(6, 3))
    for ov, c in ((True, "tab:blue"), (False, "tab:orange")):
        pts = sorted((r["dp"], r["slowdown_vs_dp1"]) for r in rs if r["overlap"] == ov)
        ax.plot(*zip(*pts), "o-", color=c, label=f"overlap {'on' if ov else 'off'}")
    for r in rs:
        if r["overlap"] and r["dp"] > 1:
            ax.annotate(f"hidden {r['hidden']:.0%}", (r["dp"], r["slowdown_vs_dp1"]), fontsize=7)
    ax.set(xlabel="dp (weak scaling: same micro-batches per rank)", ylabel="step time / dp=1 step",
           title=f"DP weak scaling, preset {d.get('preset')}: step ratio to dp=1 (ideal 1.0)")
    ax.legend(fontsize=7)
    fig.suptitle(common.machine(), fontsize=7)
    common.save(fig, png)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    kind, src, png = argv
    d = json.loads(Path(src).read_text())
    {"kernels": kernels, "train_step": train_step, "pipeline": pipeline, "dp_scaling": dp_scaling}[kind](d, png)


if __name__ == "__main__":
    main()
