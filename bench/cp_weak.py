"""Weak scaling of context parallelism: cp ranks on a sequence cp times as long as one rank's.

    python bench/cp_weak.py       # L 256 and 1024 per rank, and L 128 at width 1024 (attention ~2%)
    python bench/cp_weak.py --quick --per-rank 256 --rounds 1 --steps 4    # a quick look (bench/results/quick/)

Rows per per-rank length L: one rank training on sequences of L positions, and cp = 2 ranks
training on sequences of 2L (each rank holds L positions), with the ring and with Ulysses
(`--cp-comm a2a`); the same model, micro-batch and step count, one kernel thread per rank, float32,
`python -m pympar.train` (the preset small's model, 4 heads; L@C: its width C instead of 128).
Each configuration runs ``rounds`` times, interleaved; a run's step time is its median over the
steps after the first; a configuration's is the fastest of its runs. Rows also keep every run's
step time and each round's efficiency (its one-rank run over its cp run, minutes apart at most)
with their median: the spread between them is what one number of this benchmark is worth here.

efficiency = step time of one rank on L / step time of cp ranks on cp*L. Everything but attention
costs the same per rank in both; causal attention over cp*L positions is cp^2 times the work of L,
shared by cp ranks: each rank does cp times one rank's attention at L. So the efficiency this can
reach is 1 / (1 + (cp-1) * attention's share of the one-rank step): the ceiling printed beside each
row takes that share from the FLOPs (PaLM's count, nn.config.flops_per_token: attention 12 n_layer
T C of each token's), i.e. as if attention ran at the rest's rate. And cp's 2 ranks keep both cores
busy where one rank keeps one: efficiency_pair divides instead by the one-rank run's step time with
a second copy of it running at once (one_rank_pair_s), which takes out what the machine loses when
both cores work (shared memory bandwidth and cache, clock) and leaves what cp itself costs. Each
row keeps the trainer's time split (median seconds a step per key) of the runs it took: where cp's
time goes (compute holds the gradient sync that overlaps backward; dp_comm its wait after it).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from pympar.nn.config import GPTConfig, flops_per_token  # noqa: E402

TARGET = 0.9


def _args(n, L, comm, steps, B, C=None):
    args = ["--preset", "small", "--block-size", L * n, "--micro-batch-size", B, "--steps", steps, "--lr", "1e-3",
            "--dtype", "float32", "--threads", 1, "--dp", 1] + (["--n-embd", C] if C else [])
    if n > 1:
        args += ["--cp", n] + (["--cp-comm", comm] if comm != "ring" else [])
    return args


def one(n, L, comm, steps, B, C=None):
    """(median step time after the first, median of each time-split key) of one trainer run."""
    recs = common.steady(common.train(n, _args(n, L, comm, steps, B, C), timeout=900))
    split = {k: statistics.median(r["time_split"].get(k, 0.0) for r in recs) for k in recs[0]["time_split"]}
    return statistics.median(r["step_time"] for r in recs), split


def pair(L, steps, B, C=None):
    """The one-rank run while a second copy of it trains on the other core (both cores busy, as cp's
    ranks are): the second starts first, with no end of steps in sight, the timed one starts once the
    second has finished a step, and the second is stopped when the timed one is done (checked still
    running: a step count of its own could run out first, as 20x the timed one's did on small shapes)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = common.train_argv(_args(1, L, "ring", 10 ** 6, B, C), tmp)     # stopped below, never done first
        cmd = [common.mpiexec(), "-n", "1", sys.executable, *argv]
        bg = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=common.env(),
                              cwd=common.ROOT)
        try:
            metrics = Path(tmp) / "metrics.jsonl"
            while bg.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
                time.sleep(0.05)
            got = one(1, L, "ring", steps, B, C)
            if bg.poll() is not None:
                raise RuntimeError(f"the second one-rank run ended ({bg.returncode}) before the timed one")
        finally:
            bg.terminate()
            bg.wait(60)
    return got


def run(a):
    rows = []
    for L, C in [(int(x.split("@")[0]), int(x.split("@")[1]) if "@" in x else None) for x in a.per_rank.split(",")]:
        cfgs = [(1, "ring"), (1, "pair"), (2, "ring"), (2, "a2a")]
        best, runs = {}, {cfg: [] for cfg in cfgs}
        for _ in range(a.rounds):
            for n, comm in cfgs:
                t = pair(L, a.steps, a.micro_batch, C) if comm == "pair" else one(n, L, comm, a.steps, a.micro_batch, C)
                best[(n, comm)] = min(best.get((n, comm), (float("inf"), {})), t, key=lambda x: x[0])
                runs[(n, comm)].append(t[0])
        splits = {f"{n}-{comm}": best[(n, comm)][1] for n, comm in cfgs}
        best = {k: v[0] for k, v in best.items()}
        t1, t1_pair = best[(1, "ring")], best[(1, "pair")]
        cfg = GPTConfig.from_preset("small", **({"n_embd": C} if C else {}))
        cfg.block_size = L
        share = 12.0 * cfg.n_layer * L * cfg.n_embd / flops_per_token(cfg)      # attention's FLOPs at L
        for comm in ("ring", "a2a"):
            eff = t1 / best[(2, comm)]
            by_round = [o / c for o, c in zip(runs[(1, "ring")], runs[(2, comm)])]   # the same round's runs
            rows.append(dict(per_rank=L, n_embd=cfg.n_embd, cp=2, comm=comm, one_rank_s=t1, cp_s=best[(2, comm)],
                             efficiency=eff, efficiency_rounds=by_round,
                             efficiency_median_round=statistics.median(by_round),
                             runs_s={f"{n}-{c}": runs[(n, c)] for n, c in ((1, "ring"), (1, "pair"), (2, comm))},
                             attention_share=share, ceiling=1.0 / (1.0 + share),
                             one_rank_pair_s=t1_pair, efficiency_pair=t1_pair / best[(2, comm)],
                             time_split={k: splits[k] for k in ("1-ring", "1-pair", f"2-{comm}")}))
            print(f"  C={cfg.n_embd} L={L} cp=2 {comm:<5} one rank {t1 * 1e3:7.1f} ms (two at once "
                  f"{t1_pair * 1e3:7.1f})  cp {best[(2, comm)] * 1e3:7.1f} ms  efficiency {eff:.2f} (round by round "
                  f"{', '.join(f'{e:.2f}' for e in by_round)}; against two at "
                  f"once {t1_pair / best[(2, comm)]:.2f}; attention {share:.0%} of the one-rank FLOPs: ceiling "
                  f"{1 / (1 + share):.2f})", file=sys.stderr, flush=True)
    return dict(kind="cp_weak", machine=common.machine(), target=TARGET, steps=a.steps, rounds=a.rounds,
                micro_batch=a.micro_batch, rows=rows)


def plot(res, png):
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    key = lambda r: (r.get("n_embd", 128), r["per_rank"])      # noqa: E731 (rows before --n-embd: 128)
    Ls = sorted({key(r) for r in res["rows"]})
    for k, comm in enumerate(("ring", "a2a")):
        vals = [next(r["efficiency"] for r in res["rows"] if key(r) == L and r["comm"] == comm) for L in Ls]
        xs = [i + 0.38 * (k - 0.5) for i in range(len(Ls))]
        ax.bar(xs, vals, width=0.38, label=comm)
        pr = [(x, r["efficiency_pair"]) for x, L in zip(xs, Ls) for r in res["rows"]
              if key(r) == L and r["comm"] == comm and "efficiency_pair" in r]
        if pr:
            ax.plot([p[0] for p in pr], [p[1] for p in pr], "ko", mfc="none", ms=4,
                    label="against two one-rank runs at once" if k == 0 else None)
    ceil = [next(r["ceiling"] for r in res["rows"] if key(r) == L) for L in Ls]
    ax.plot(range(len(Ls)), ceil, "k_", ms=30, label="ceiling (attention's FLOP share)")
    ax.axhline(TARGET, color="tab:red", lw=0.8, ls="--")
    ax.set(xticks=range(len(Ls)), ylabel="one rank on L / cp=2 on 2L", ylim=(0, 1.25))
    ax.set_title(f"CP weak scaling, cp = 2, micro-batch {res.get('micro_batch', 2)} (dashed: {TARGET} target)\n"
                 f"{res['machine']}", fontsize=7)
    ax.set_xticklabels([f"C {C}, L {L}" for C, L in Ls])
    ax.legend(fontsize=6, loc="upper right", ncol=3)
    common.save(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-rank", default="256,1024,128@1024", help="positions per rank (comma-separated; "
                    "L@C: at model width C instead of the small preset's 128)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch (the gradient sync's "
                    "share of a step shrinks as it grows)")
    common.run_and_write(ap, argv, "cp_weak", run, plot)


if __name__ == "__main__":
    main()
