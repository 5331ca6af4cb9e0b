"""Plots of a finished run: ``python -m pympar.report DIR`` (DIR = the run's --out).

Writes into DIR (headless, matplotlib's Agg backend):
  loss.png        train loss per step and validation loss where measured
  throughput.png  tokens/s and MFU per step
  time_split.png  seconds per step, stacked by category (compute, dp/tp/pp/ep comm, bubble, optimizer)
  experts.png     layer x expert heatmap of the share of tokens per expert (MoE runs only)
  pipeline.png    one step's timeline per rank from trace.json (runs with --profile only)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .profile import SPLIT

_COLORS = {"compute": "tab:blue", "dp_comm": "tab:orange", "tp_comm": "tab:green", "pp_comm": "tab:red",
           "ep_comm": "tab:purple", "bubble": "tab:gray", "optimizer": "tab:olive", "layer": "tab:cyan"}


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(m, out, plt):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in m], [r["loss"] for r in m], label="train")
    val = [(r["step"], r["val_loss"]) for r in m if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax.legend()
    _save(fig, out / "loss.png", plt)


def plot_throughput(m, out, plt):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in m]
    ax.plot(steps, [r["tokens_per_s"] for r in m], color="tab:blue")
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax2 = ax.twinx()
    ax2.plot(steps, [100 * r["mfu"] for r in m], color="tab:red")
    ax2.set_ylabel("MFU (%)", color="tab:red")
    _save(fig, out / "throughput.png", plt)


def plot_time_split(m, out, plt):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = np.array([r["step"] for r in m])
    bottom = np.zeros(len(m))
    for k in SPLIT:
        v = np.array([1000 * r["time_split"].get(k, 0.0) for r in m])
        if v.any():
            ax.bar(steps, v, bottom=bottom, label=k, color=_COLORS[k], width=1.0)
            bottom += v
    other = np.array([1000 * r["step_time"] for r in m]) - bottom
    ax.bar(steps, np.clip(other, 0, None), bottom=bottom, label="other", color="lightgray", width=1.0)
    ax.set(xlabel="step", ylabel="ms (rank 0)", title="time split per step")
    ax.legend(fontsize=7, ncol=2)
    _save(fig, out / "time_split.png", plt)


def plot_experts(m, out, plt) -> bool:
    """Share of routed tokens per expert, summed over the run; False when not an MoE run."""
    layers = {}
    for r in m:
        for s in r.get("moe") or []:
            layers.setdefault(s["layer"], np.zeros(len(s["tokens_per_expert"])))
            layers[s["layer"]] += s["tokens_per_expert"]
    if not layers:
        return False
    keys = sorted(layers)
    share = np.array([layers[k] / max(layers[k].sum(), 1) for k in keys])   # (layers, experts)
    fig, ax = plt.subplots(figsize=(1.5 + 0.5 * share.shape[1], 1.2 + 0.5 * len(keys)))
    im = ax.imshow(share, cmap="viridis", aspect="auto")
    ax.set(xlabel="expert", ylabel="layer", title="share of tokens per expert",
           yticks=range(len(keys)), yticklabels=keys, xticks=range(share.shape[1]))
    fig.colorbar(im, ax=ax)
    _save(fig, out / "experts.png", plt)
    return True


def plot_pipeline(trace_path: Path, out, plt, step: int | None = None) -> bool:
    """Timeline of one step (the last-but-one when there are several) per rank."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    steps = sorted((e for e in events if e.get("cat") == "step" and e.get("pid") == 0), key=lambda e: e["ts"])
    if not steps:
        return False
    pick = steps[step] if step is not None else steps[-2 if len(steps) > 1 else -1]
    t0, t1 = pick["ts"], pick["ts"] + pick["dur"]
    ranks = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.45 * len(ranks)))
    seen = set()
    for e in events:
        if e.get("ph") != "X" or e["cat"] in ("step", "eval") or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
            continue
        row = ranks.index(e["pid"])
        nested = e["cat"] == "layer"
        color = _COLORS.get(e["cat"], "black")
        label = e["cat"] if e["cat"] not in seen else None
        seen.add(e["cat"])
        ax.barh(row + (0.2 if nested else 0), (e["dur"]) / 1000, left=(e["ts"] - t0) / 1000,
                height=0.35 if nested else 0.8, color=color, edgecolor="white", linewidth=0.3, label=label,
                zorder=3 if nested else 2)
    ax.set_xlim(0, (t1 - t0) / 1000)
    ax.set(yticks=range(len(ranks)), yticklabels=[f"rank {r}" for r in ranks], xlabel="ms since the step began",
           title=f"timeline of {pick['name']}")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, out / "pipeline.png", plt)
    return True


def _save(fig, path, plt):
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def make_report(run_dir) -> list[Path]:
    """Draw every plot the run's files allow; return the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    mpath = run_dir / "metrics.jsonl"
    if not mpath.exists():
        raise FileNotFoundError(f"{mpath}: no metrics file; run pympar.train with --out {run_dir}")
    m = read_metrics(mpath)
    if not m:
        raise ValueError(f"{mpath}: holds no steps")
    plot_loss(m, run_dir, plt)
    plot_throughput(m, run_dir, plt)
    plot_time_split(m, run_dir, plt)
    wrote = [run_dir / n for n in ("loss.png", "throughput.png", "time_split.png")]
    if plot_experts(m, run_dir, plt):
        wrote.append(run_dir / "experts.png")
    if (run_dir / "trace.json").exists() and plot_pipeline(run_dir / "trace.json", run_dir, plt):
        wrote.append(run_dir / "pipeline.png")
    return wrote


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pympar.report", description="PNG plots of a pympar.train run directory.")
    p.add_argument("run_dir", help="the --out directory of a run (holds metrics.jsonl, maybe trace.json)")
    a = p.parse_args(argv)
    try:
        for path in make_report(a.run_dir):
            print(path)
    except (FileNotFoundError, ValueError) as e:
        print(f"pympar.report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
