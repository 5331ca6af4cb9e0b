"""Plots of a finished run: ``python -m pympar.report DIR`` (DIR = the run's --out).

Writes into DIR (headless, matplotlib's Agg backend):
  loss.png        train loss per step and validation loss where measured
  throughput.png  tokens/s and MFU per step
  time_split.png  seconds per step, stacked by category (compute, dp/tp/pp/ep comm, bubble, optimizer)
  experts.png     per MoE layer a step x expert heat map of each expert's share of the routed
                  tokens with the dropped fraction beside it, and with --ep > 1 the share per EP
                  rank over training (MoE runs only)
  pipeline.png    one step's timeline per rank from trace.json (runs with --profile only)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np

from .metrics import read_records
from .profile import SPLIT

_COLORS = {"compute": "tab:blue", "dp_comm": "tab:orange", "tp_comm": "tab:green", "pp_comm": "tab:red",
           "ep_comm": "tab:purple", "cp_comm": "tab:brown", "bubble": "tab:gray", "optimizer": "tab:olive", "layer": "tab:cyan"}


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl (metrics.read_records). A last line cut short (what a killed run
    leaves) is left out with a note on stderr; a line elsewhere that is not a step's record is a
    ValueError naming the file and line."""
    rows, bad = read_records(path)
    if bad:
        line, what, cut = bad
        if not cut:
            raise ValueError(f"{path}: line {line} {what}; a damaged or foreign metrics file")
        print(f"pympar.report: {path}: line {line} {what}: left out", file=sys.stderr)
    return rows


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


def expert_series(m):
    """{layer: (steps (S,), share (S, E) of the step's routed tokens per expert, dropped (S,))}."""
    rows = {}
    for r in m:
        for st in r.get("moe") or []:
            rows.setdefault(st["layer"], []).append((r["step"], st["tokens_per_expert"], st.get("dropped_fraction", 0.0)))
    out = {}
    for layer, rs in rows.items():
        tok = np.array([t for _, t, _ in rs], dtype=np.float64)
        out[layer] = (np.array([s for s, _, _ in rs]), tok / np.maximum(tok.sum(axis=1, keepdims=True), 1),
                      np.array([d for _, _, d in rs], dtype=np.float64))
    return out


def _rows_per_rank(m, ranks):
    """(S, ranks) share of the rows each ep rank ran per step (layers averaged), or None when the
    records do not carry them."""
    out = []
    for r in m:
        rows = [st["rows_per_ep_rank"] for st in r.get("moe") or [] if len(st.get("rows_per_ep_rank") or []) == ranks]
        if not rows:
            return None
        v = np.asarray(rows, np.float64)
        out.append((v / np.maximum(v.sum(axis=1, keepdims=True), 1)).mean(axis=0))
    return np.array(out) if out else None


def plot_experts(m, out, plt, ep: int = 1) -> bool:
    """Expert utilisation over training; False when not an MoE run.

    One row per MoE layer: a heat map of each expert's share of the step's routed tokens
    (x: step, y: expert; 1/E is an even split) and, beside it, the fraction of token
    assignments dropped by the capacity limit. With expert parallelism (ep > 1) a last row shows
    the share of each EP rank (rank r holds experts [r E/ep, (r+1) E/ep)), layers summed: which
    rank's experts are hot; where the records carry the rows each rank ran (``rows_per_ep_rank``:
    replicated experts move rows off their home rank) it plots those, the ranks' actual load."""
    series = expert_series(m)
    if not series:
        return False
    keys = sorted(series)
    E = series[keys[0]][1].shape[1]
    ranks = ep if ep > 1 and E % ep == 0 else 1
    n_rows = len(keys) + (1 if ranks > 1 else 0)
    fig, axes = plt.subplots(n_rows, 2, figsize=(9, 1.2 + 1.6 * n_rows), squeeze=False,
                             gridspec_kw=dict(width_ratios=[5, 1.3]))
    vmax = max(float(series[k][1].max()) for k in keys)
    for i, k in enumerate(keys):
        steps, share, dropped = series[k]
        ax = axes[i][0]
        im = ax.imshow(share.T, aspect="auto", cmap="magma", vmin=0, vmax=vmax, interpolation="nearest",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, E - 0.5, -0.5))
        ax.set(ylabel=f"layer {k}\nexpert", yticks=range(E) if E <= 16 else None)
        fig.colorbar(im, ax=ax, label=f"share (even {1 / E:.2f})", pad=0.01)
        d = axes[i][1]
        d.plot(steps, 100 * dropped, color="tab:red", lw=1)
        d.set(ylabel="dropped %", ylim=(0, max(1.0, 100 * float(dropped.max()) * 1.1)))
        if i == 0:
            ax.set_title("share of each step's routed tokens per expert")
            d.set_title("dropped")
    if ranks > 1:
        ax = axes[-1][0]
        steps = series[keys[0]][0]
        per = E // ranks
        total = sum(series[k][1] for k in keys) / len(keys)               # (S, E), layers averaged
        ran = _rows_per_rank(m, ranks)
        for r in range(ranks):
            share = ran[:, r] if ran is not None else total[:, r * per:(r + 1) * per].sum(axis=1)
            ax.plot(steps[:len(share)], share, label=f"ep rank {r} (experts {r * per}-{(r + 1) * per - 1})")
        ax.axhline(1 / ranks, color="k", lw=0.6, ls="--")
        what = "rows each rank ran (replicas included)" if ran is not None else "which rank's experts are hot"
        ax.set(ylabel="share per EP rank", title=f"{what} (layers averaged; dashed: even)")
        ax.legend(fontsize=6, ncol=min(4, ranks))
        axes[-1][1].axis("off")
    axes[-1][0].set_xlabel("step")
    axes[-1][1].set_xlabel("step")
    _save(fig, out / "experts.png", plt)
    return True


def plot_pipeline(trace_path: Path, out, plt, step: int | None = None) -> bool:
    """Timeline of one step (the last-but-one when there are several) per rank."""
    try:
        if not trace_path.is_file():        # a pipe would block
            raise ValueError("not a regular file")
        events = json.loads(trace_path.read_text())["traceEvents"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"{trace_path}: not a Chrome trace of pympar.train ({e!r})") from None
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
    ep = 1
    if (run_dir / "summary.json").exists():     # the layout the run used (expert-parallel size)
        try:
            ep = int(json.loads((run_dir / "summary.json").read_text())["config"]["parallel"]["ep"])
        except (ValueError, KeyError, TypeError, RecursionError, OSError):
            ep = 1
    with _foreign(mpath):                       # a record of the right shape with the wrong fields
        plot_loss(m, run_dir, plt)
        plot_throughput(m, run_dir, plt)
        plot_time_split(m, run_dir, plt)
        wrote = [run_dir / n for n in ("loss.png", "throughput.png", "time_split.png")]
        if plot_experts(m, run_dir, plt, ep=ep):
            wrote.append(run_dir / "experts.png")
    trace = run_dir / "trace.json"
    if trace.exists():
        with _foreign(trace):
            if plot_pipeline(trace, run_dir, plt):
                wrote.append(run_dir / "pipeline.png")
    return wrote


@contextlib.contextmanager
def _foreign(path):
    """What a plot raises on fields that are not pympar.train's (a missing key, a string where a
    number goes, a list where an object goes): ValueError naming the file."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
        raise ValueError(f"{path}: not what pympar.train writes ({type(e).__name__}: {e})") from None


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
    except OSError as e:                         # a directory where a file was expected, no permission
        print(f"pympar.report: error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
