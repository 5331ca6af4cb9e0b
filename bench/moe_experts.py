"""A rank's local experts: one grouped call (csrc/grouped.cpp) against one MLP call per expert.

    python bench/moe_experts.py                          # 8, 32, 64 experts; 1 and 2 threads; 1024 and 4096 rows
    python bench/moe_experts.py --experts 32 --threads 1 --reps 3      # a quick look

What is timed: ``MoE.run_experts`` and ``run_experts_backward`` (forward and backward of every
local expert's MLP: c_fc, GELU, c_proj and all their gradients) over the rows one micro-batch
routes to the rank, in float32 and in bfloat16 (float32 master weights, bf16 activations and
products: the trainer's ``--dtype bfloat16``; the weights' bf16 copies cast and packed once, as in
a training step's weight cache), the moe-small model's width (C 128, hidden 512). The rows are
uneven: ``--rows`` assignments (1024 and 4096: 512 and 2048 tokens at top-2) split over the experts by a Zipf law
of exponent ``--zipf`` (loads proportional to 1/rank^s; s = 1: the hottest expert gets ~15x
the mean at 64 experts), drawn once with a fixed seed, so some experts get a handful of rows
and a few get hundreds. The same MoE object runs both ways (``MoE.grouped``), alternating in
rounds; each figure is the fastest of ``--reps`` calls of a round, the best round kept. Both ways
make the same products on the same operands (tests/test_moe_grouped.py: bitwise the same
outputs and gradients), so the ratio is the cost of the per-expert Python calls and of the
threads the loop cannot keep busy; ``grouped_gflops`` (the six products' FLOPs over the grouped
time) says how close the grouped call runs to the products alone.

PyTorch (eager, its per-expert loop under autograd, the way an MoE layer is written without a
grouped kernel: PyTorch's CPU build has no grouped GEMM) is timed on the same rows as a peer
when torch is installed (bfloat16: under CPU autocast, the one line a PyTorch user adds).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:                                   # before pympar's MKL: torch keeps its own (kernels/gemm.py)
    import torch
except ImportError:
    torch = None
import numpy as np  # noqa: E402

import common  # noqa: E402
from pympar import kernels  # noqa: E402
from pympar.backend import bfloat16  # noqa: E402
from pympar.kernels import gemm  # noqa: E402
from pympar.nn.moe import MoE  # noqa: E402
from pympar.nn.products import compute_copies# noqa: E402

TARGET = 1.5                            # grouped over the loop at 32 local experts, uneven groups


def zipf_counts(rows, n_expert, s, seed=0):
    """rows assignments over n_expert experts, loads proportional to 1/rank^s (ranks shuffled)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_expert + 1) ** s
    p = rng.permutation(p / p.sum())
    return rng.multinomial(rows, p)


def torch_loop(C, counts, xs, dys, threads, lowp):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(4 * C, C, generator=g) * 0.02, torch.zeros(4 * C), torch.randn(C, 4 * C, generator=g) * 0.02,
           torch.zeros(C)) for _ in counts]
    for w in ws:
        for t in w:
            t.requires_grad_(True)
    x = torch.from_numpy(xs.astype(np.float32)).requires_grad_(True)
    dy = torch.from_numpy(dys.astype(np.float32))
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()

    def step():
        outs = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=lowp):
            for (w1, b1, w2, b2), a, b in zip(ws, bounds[:-1], bounds[1:]):
                if b > a:
                    h = torch.nn.functional.gelu(torch.nn.functional.linear(x[a:b], w1, b1), approximate="tanh")
                    outs.append(torch.nn.functional.linear(h, w2, b2))
            y = torch.cat(outs)
        torch.autograd.backward(y, dy.to(y.dtype))
    return step


def one(C, n_expert, rows, zipf, threads, reps, rounds, dtype):
    kernels.set_num_threads(threads)
    counts = zipf_counts(rows, n_expert, zipf)
    lowp = dtype == "bfloat16"
    m = MoE(C, n_expert, name="moe", top_k=2, seed=0, compute_dtype=bfloat16 if lowp else None)
    rng = np.random.default_rng(1)
    adt = bfloat16 if lowp else np.float32
    xs = rng.standard_normal((rows, C)).astype(adt)
    dys = rng.standard_normal((rows, C)).astype(adt)

    def step():
        ys, ctx = m.run_experts(xs, counts)
        m.run_experts_backward(dys, ctx)

    t = {"loop": float("inf"), "grouped": float("inf")}
    with compute_copies():                           # a step's weight cache: bf16 copies cast and packed once
        for _ in range(rounds):
            for way in ("loop", "grouped"):
                m.grouped = way == "grouped"
                t[way] = min(t[way], common.best(step, reps, warm_s=0.05))
        m.grouped = True
        if m.run_experts(xs, counts)[1][0] != "grouped":
            raise SystemExit(f"error: the grouped call does not run for {dtype} here (bf16: AMX only)")
    row = dict(dtype=dtype, n_expert=n_expert, threads=threads, rows=rows, counts=counts.tolist(), loop_ms=t["loop"] * 1e3,
               grouped_ms=t["grouped"] * 1e3, speedup=t["loop"] / t["grouped"],
               max_over_mean=float(counts.max() / counts.mean()), min_rows=int(counts.min()),
               # the six products of forward and backward, 2 * rows * C * 4C FLOPs each
               grouped_gflops=12 * rows * C * 4 * C / t["grouped"] / 1e9)
    if torch is not None:
        ts = min(common.best(torch_loop(C, counts, xs, dys, threads, lowp), reps, warm_s=0.05) for _ in range(rounds))
        row.update(torch_ms=ts * 1e3, torch_over_grouped=ts / t["grouped"])
    print(f"  {dtype:<8}  rows {rows:>5}  E {n_expert:>3}  threads {threads}  loop {row['loop_ms']:7.2f} ms  grouped {row['grouped_ms']:7.2f} ms"
          f"  {row['speedup']:.2f}x" + (f"  torch {row['torch_ms']:7.2f} ms" if torch is not None else ""),
          file=sys.stderr, flush=True)
    return row


def run(a):
    if "bfloat16" in a.dtypes and gemm.bf16_engine() not in gemm.OWN_BF16:
        raise SystemExit(f"error: bf16 experts run grouped on pympar's AMX or AVX512-BF16 kernel only (bf16 engine "
                         f"here: {gemm.bf16_engine()}); "
                         "pass --dtypes float32")
    if gemm.gemm_address(np.float32) is None:
        raise SystemExit("error: the grouped call runs on MKL (pip install 'pympar[mkl]'); NumPy's BLAS is selected")
    rows = [one(a.width, e, n, a.zipf, t, a.reps, a.rounds, d) for d in a.dtypes for n in a.rows for t in a.threads
            for e in a.experts]
    targets = {}
    for d in a.dtypes:
        at32 = [r["speedup"] for r in rows if r["n_expert"] == 32 and r["dtype"] == d]
        if at32:
            targets[f"grouped experts over the per-expert loop at 32 local experts, {d}, uneven groups, worst of "
                    f"{len(at32)} (rows x threads) (target >= {TARGET})"] = min(at32)
    return dict(machine=common.machine(), width=a.width, hidden=4 * a.width, zipf=a.zipf, rows_total=a.rows,
                dtypes=a.dtypes, bf16_engine=gemm.bf16_engine(), gemm=gemm.describe(), torch=None if torch is None else torch.__version__,
                rows=rows, targets=targets)


def plot(res, path):
    plt = common.pyplot()
    if plt is None:
        return
    totals = sorted({(r["dtype"], r["rows"]) for r in res["rows"]}, key=lambda k: (k[0] != "float32", k[1]))
    cols = min(2, len(totals))
    nrow = (len(totals) + cols - 1) // cols
    fig, axes = plt.subplots(nrow, cols, figsize=(5.2 * cols, 3.4 * nrow), squeeze=False)
    threads = sorted({r["threads"] for r in res["rows"]})
    experts = sorted({r["n_expert"] for r in res["rows"]})
    w = 0.8 / max(1, 2 * len(threads))
    for ax, (dt, n) in zip(axes.reshape(-1), totals):
        for i, t in enumerate(threads):
            for j, (key, name) in enumerate((("loop_ms", "per-expert loop"), ("grouped_ms", "grouped"))):
                ys = [next(r[key] for r in res["rows"] if r["threads"] == t and r["n_expert"] == e and r["rows"] == n
                           and r["dtype"] == dt) for e in experts]
                ax.bar([k + (2 * i + j) * w for k in range(len(experts))], ys, w, label=f"{name}, {t} thread(s)")
        ax.set_xticks([k + w * (len(threads) - 0.5) for k in range(len(experts))], [f"{e} experts" for e in experts])
        ax.set_ylabel("forward + backward (ms)")
        ax.set_title(f"{dt}, {n} rows, Zipf {res['zipf']}, C {res['width']}", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    common.save(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=lambda s: [int(v) for v in s.split(",")], default=[8, 32, 64])
    ap.add_argument("--threads", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2])
    ap.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1024, 4096])
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    return common.run_and_write(ap, argv, "moe_experts", run, plot)


if __name__ == "__main__":
    main()
