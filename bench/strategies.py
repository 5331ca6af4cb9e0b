"""Throughput of the parallel strategies for the same model, rank count and global batch:
DP alone, PP alone, DP+PP, and TP, EP (dense ``small`` and MoE ``moe-small``), each a real
``python -m pympar.train`` run; tokens/s relative to DP alone, and the time split.

    python bench/strategies.py --world 4 --json bench/results/strategies.json --png docs/img/strategies.png
    python bench/strategies.py --world 4,8 --steps 8            # both rank counts

Every layout keeps the global batch (sequences per optimiser step) of its rank count, so the
runs do the same work per step: tokens/s compares like with like. On this 2-core machine,
4 and 8 ranks oversubscribe the cores: compute does not scale, so what is compared is the
overhead each strategy adds (bubble, communication, smaller matmuls), not the speed-up a
machine with a core per rank would show. A layout this build cannot run is kept in the
table as "not yet" with the trainer's message.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# (label, preset, flags) per world size; the global batch G = mbs * n_micro * dp is fixed per world
LAYOUTS = {
    4: [  # G = 16 sequences
        ("DP4", "small", "--dp 4 --micro-batch-size 4 --n-micro 1"),
        ("PP4 (1F1B, m=16)", "small", "--pp 4 --micro-batch-size 1 --n-micro 16"),
        ("DP2 x PP2 (m=4)", "small", "--dp 2 --pp 2 --micro-batch-size 2 --n-micro 4"),
        ("TP4", "small", "--tp 4 --micro-batch-size 16 --n-micro 1"),
        ("DP2 x TP2", "small", "--dp 2 --tp 2 --micro-batch-size 8 --n-micro 1"),
        ("PP2 x TP2 (m=4)", "small", "--pp 2 --tp 2 --micro-batch-size 4 --n-micro 4"),
        ("MoE DP4", "moe-small", "--dp 4 --micro-batch-size 4 --n-micro 1"),
        ("MoE DP4 x EP2", "moe-small", "--dp 4 --ep 2 --micro-batch-size 4 --n-micro 1"),
        ("MoE DP4 x EP4", "moe-small", "--dp 4 --ep 4 --micro-batch-size 4 --n-micro 1"),
        ("MoE DP2 x PP2 x EP2", "moe-small", "--dp 2 --pp 2 --ep 2 --micro-batch-size 2 --n-micro 4"),
    ],
    8: [  # G = 32 sequences
        ("DP8", "small", "--dp 8 --micro-batch-size 4 --n-micro 1"),
        ("PP4 x DP2 (m=16)", "small", "--pp 4 --dp 2 --micro-batch-size 1 --n-micro 16"),
        ("DP4 x PP2 (m=4)", "small", "--dp 4 --pp 2 --micro-batch-size 2 --n-micro 4"),
        ("DP2 x TP4", "small", "--dp 2 --tp 4 --micro-batch-size 16 --n-micro 1"),
        ("DP4 x TP2", "small", "--dp 4 --tp 2 --micro-batch-size 8 --n-micro 1"),
        ("DP2 x PP2 x TP2 (m=4)", "small", "--dp 2 --pp 2 --tp 2 --micro-batch-size 4 --n-micro 4"),
        ("MoE DP8", "moe-small", "--dp 8 --micro-batch-size 4 --n-micro 1"),
        ("MoE DP8 x EP8", "moe-small", "--dp 8 --ep 8 --micro-batch-size 4 --n-micro 1"),
        ("MoE DP4 x PP2 x EP4", "moe-small", "--dp 4 --pp 2 --ep 4 --micro-batch-size 2 --n-micro 4"),
    ],
}
SPLIT = ("compute", "dp_comm", "tp_comm", "pp_comm", "ep_comm", "bubble", "optimizer")


def run_once(world: int, label: str, preset: str, flags: str, steps: int, warmup: int, timeout: float) -> dict:
    args = ["--preset", preset, *flags.split(), "--steps", str(steps + warmup), "--warmup", "2"]
    row = dict(world=world, label=label, preset=preset, flags=flags)
    try:
        m = common.steady(common.train(world, args, timeout), warmup)
    except RuntimeError as e:
        msg = str(e).strip().splitlines()
        err = next((l for l in msg if "error" in l.lower()), msg[-1] if msg else "failed")
        return dict(row, status="not yet", error=err[-300:])
    split = {k: sum(r["time_split"].get(k, 0.0) for r in m) / sum(r["step_time"] for r in m) for k in SPLIT}
    return dict(row, status="ok", tokens_per_s=common.median(m, "tokens_per_s"), step_s=common.median(m, "step_time"),
                mfu=common.median(m, "mfu"), split=split, loss_last=m[-1]["loss"], steps=len(m))


def run(world: int, steps: int, warmup: int, timeout: float, rounds: int) -> list:
    """Every layout once per round, rounds interleaved (the machine's load drifts between runs);
    per layout the median over rounds of each run's median step."""
    runs = {label: [] for label, _, _ in LAYOUTS[world]}
    for k in range(rounds):
        for label, preset, flags in LAYOUTS[world]:
            r = run_once(world, label, preset, flags, steps, warmup, timeout)
            runs[label].append(r)
            how = f"{r['tokens_per_s']:9.0f} tok/s" if r["status"] == "ok" else "not yet: " + r["error"][-120:]
            print(f"  w{world} round {k + 1} {label:<24} {how}", file=sys.stderr, flush=True)
    rows = []
    for label, rs in runs.items():
        ok = [r for r in rs if r["status"] == "ok"]
        if not ok:
            rows.append(rs[0])
            continue
        mid = sorted(ok, key=lambda r: r["tokens_per_s"])[(len(ok) - 1) // 2]
        rows.append(dict(mid, rounds=[r["tokens_per_s"] for r in ok]))
    for preset in ("small", "moe-small"):             # ratios against DP alone of the same model
        base = next((r for r in rows if r["preset"] == preset and r["status"] == "ok"), None)
        for r in rows:
            if r["preset"] == preset and r["status"] == "ok" and base:
                r["vs_dp"] = r["tokens_per_s"] / base["tokens_per_s"]
                r["baseline"] = base["label"]
    return rows


def plot(rows: list, png) -> None:
    plt = common.pyplot()
    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(len(worlds), 2, figsize=(9, 2.2 + 0.28 * max(len(LAYOUTS[w]) for w in worlds) * len(worlds)),
                             squeeze=False)
    colors = {"compute": "tab:blue", "dp_comm": "tab:orange", "tp_comm": "tab:green", "pp_comm": "tab:red",
              "ep_comm": "tab:purple", "bubble": "tab:gray", "optimizer": "tab:olive"}
    for ax, ax2, w in [(a[0], a[1], w) for a, w in zip(axes, worlds)]:
        rs = [r for r in rows if r["world"] == w][::-1]
        y = range(len(rs))
        vals = [r.get("vs_dp", 0.0) for r in rs]
        ax.barh(y, vals, color=["tab:blue" if r["preset"] == "small" else "tab:purple" for r in rs])
        ax.set_yticks(list(y), [r["label"] for r in rs])
        for i, r in enumerate(rs):
            ax.text(max(vals[i], 0.02), i, f" {vals[i]:.2f}x" if r["status"] == "ok" else " not yet", va="center")
        ax.axvline(1.0, color="k", lw=0.6)
        ax.set(xlabel="tokens/s relative to DP alone (same model)", title=f"{w} ranks: throughput ratio to DP alone")
        left = [0.0] * len(rs)
        for k in SPLIT:
            v = [r["split"][k] if r["status"] == "ok" else 0.0 for r in rs]
            ax2.barh(y, v, left=left, color=colors[k], label=k)
            left = [a + b for a, b in zip(left, v)]
        ax2.set_yticks(list(y), [""] * len(rs))
        ax2.set(xlabel=f"fraction of step time ({w} ranks)", xlim=(0, 1.05))
    axes[0][1].legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, 1.25), ncol=4, frameon=False)
    fig.suptitle(f"Strategies, same model / ranks / global batch ({common.machine()})", fontsize=8)
    common.save(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="4", help="comma-separated rank counts of LAYOUTS (4, 8)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    ap.add_argument("--rounds", type=int, default=2, help="runs per layout, interleaved; the median is kept")
    ap.add_argument("--timeout", type=float, default=600)
    common.add_output_args(ap, "strategies")
    a = common.resolve_outputs(ap.parse_args(argv))
    rows = []
    for w in [int(x) for x in a.world.split(",")]:
        if w not in LAYOUTS:
            ap.error(f"--world {w}: layouts are defined for {sorted(LAYOUTS)}")
        rows += run(w, a.steps, a.warmup, a.timeout, a.rounds)
    common.write_json(a.json, dict(kind="strategies", machine=common.machine(), steps=a.steps, rounds=a.rounds, rows=rows))
    plot(rows, a.png)
    print(f"wrote {a.json} {a.png}")


if __name__ == "__main__":
    main()
