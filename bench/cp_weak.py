"""Weak scaling of context parallelism: cp ranks on a sequence cp times as long as one rank's.

    python bench/cp_weak.py                  # T 1024 and 2048 per rank, cp = 2, ring and a2a
    python bench/cp_weak.py --per-rank 256 --rounds 1 --steps 4    # a quick look

Rows per per-rank length L: one rank training on sequences of L positions, and cp = 2 ranks
training on sequences of 2L (each rank holds L positions), with the ring and with Ulysses
(`--cp-comm a2a`); the same model, micro-batch and step count, one kernel thread per rank, float32,
`python -m pympar.train` (the preset small's model, 4 heads). Each configuration runs ``rounds``
times, interleaved; a run's step time is its median over the steps after the first; a
configuration's is the fastest of its runs.

efficiency = step time of one rank on L / step time of cp ranks on cp*L. Everything but attention
costs the same per rank in both; causal attention over cp*L positions is cp^2 times the work of L,
shared by cp ranks: each rank does cp times one rank's attention at L. So the efficiency this can
reach is 1 / (1 + (cp-1) * attention's share of the one-rank step): the ceiling printed beside each
row takes that share from the FLOPs (PaLM's count, nn.config.flops_per_token: attention 12 n_layer
T C of each token's), i.e. as if attention ran at the rest's rate.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from pympar.nn.config import GPTConfig, flops_per_token  # noqa: E402

TARGET = 0.9


def one(n, L, comm, steps, B):
    args = ["--preset", "small", "--block-size", L * n, "--micro-batch-size", B, "--steps", steps, "--lr", "1e-3",
            "--dtype", "float32", "--threads", 1, "--dp", 1]
    if n > 1:
        args += ["--cp", n] + (["--cp-comm", comm] if comm != "ring" else [])
    recs = common.steady(common.train(n, args, timeout=900))
    return statistics.median(r["step_time"] for r in recs)


def run(a):
    rows = []
    for L in [int(x) for x in a.per_rank.split(",")]:
        cfgs = [(1, "ring"), (2, "ring"), (2, "a2a")]
        best = {}
        for _ in range(a.rounds):
            for n, comm in cfgs:
                best[(n, comm)] = min(best.get((n, comm), float("inf")), one(n, L, comm, a.steps, a.micro_batch))
        t1 = best[(1, "ring")]
        cfg = GPTConfig.from_preset("small")
        cfg.block_size = L
        share = 12.0 * cfg.n_layer * L * cfg.n_embd / flops_per_token(cfg)      # attention's FLOPs at L
        for comm in ("ring", "a2a"):
            eff = t1 / best[(2, comm)]
            rows.append(dict(per_rank=L, cp=2, comm=comm, one_rank_s=t1, cp_s=best[(2, comm)], efficiency=eff,
                             attention_share=share, ceiling=1.0 / (1.0 + share)))
            print(f"  L={L} cp=2 {comm:<5} one rank {t1 * 1e3:7.1f} ms  cp {best[(2, comm)] * 1e3:7.1f} ms  "
                  f"efficiency {eff:.2f} (attention {share:.0%} of the one-rank FLOPs: ceiling {1 / (1 + share):.2f})",
                  file=sys.stderr, flush=True)
    return dict(kind="cp_weak", machine=common.machine(), target=TARGET, steps=a.steps, rounds=a.rounds,
                micro_batch=a.micro_batch, rows=rows)


def plot(res, png):
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    Ls = sorted({r["per_rank"] for r in res["rows"]})
    for k, comm in enumerate(("ring", "a2a")):
        vals = [next(r["efficiency"] for r in res["rows"] if r["per_rank"] == L and r["comm"] == comm) for L in Ls]
        ax.bar([i + 0.38 * (k - 0.5) for i in range(len(Ls))], vals, width=0.38, label=comm)
    ceil = [next(r["ceiling"] for r in res["rows"] if r["per_rank"] == L) for L in Ls]
    ax.plot(range(len(Ls)), ceil, "k_", ms=30, label="ceiling (attention's FLOP share)")
    ax.axhline(TARGET, color="tab:red", lw=0.8, ls="--")
    ax.set(xticks=range(len(Ls)), ylabel="one rank on L / cp=2 on 2L", ylim=(0, 1.25))
    ax.set_title(f"CP weak scaling, cp = 2 (dashed: {TARGET} target)\n{res['machine']}", fontsize=7)
    ax.set_xticklabels([f"L = {L}" for L in Ls])
    ax.legend(fontsize=6, loc="upper right", ncol=3)
    common.save(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-rank", default="1024,2048", help="positions per rank (comma-separated)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    common.run_and_write(ap, argv, "cp_weak", run, plot)


if __name__ == "__main__":
    main()
