"""The GEMMs of a training step: NumPy's BLAS, pympar's products (nn.products.matmul: Intel MKL
where installed, kernels/gemm.py, else NumPy's BLAS) and PyTorch's BLAS (what its eager and
compiled steps call), the same shapes and operand layouts, the same threads, one process.

    python bench/gemm.py                    # the three shapes of bench/train_step.py, 1 and 2 threads
    python bench/gemm.py --threads 1 --reps 3 --shapes L4:256:1024:256   # one shape, quickly

For each shape (layers, width, tokens per micro-batch, vocabulary) the step's products are
those pympar's Linear layers and head run: per layer qkv, attention projection, c_fc and c_proj,
each forward y = x W^T, backward dx = dy W and dW = dy^T x, and the head's logits, dh and dW
(whole, where pympar runs it in row chunks). Each product is timed on the three, alternating in
blocks (two rounds, each the best of --reps calls after a pause that lets the other library's
spinning threads go idle); the step's GEMM time is the sum over the step's products. The threads
are set as pympar.train sets them (kernels.set_process_threads: OpenBLAS on the kernels' pool).
Attention's own products are not here (pympar's are inside its C++ kernel). The ratios say how
much of a step's speed the BLAS alone decides: > 1 means PyTorch's BLAS is faster.
Each thread count runs in its own process, the libraries' thread counts set before they load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, best, machine, pyplot, run_and_write, save  # noqa: E402


# (name, n_layer, n_embd, tokens, vocab): bench/train_step.py's shapes (issue 14)
SHAPES = [("L4 D256 T128 B8", 4, 256, 1024, 256), ("L6 D512 T256 B4", 6, 512, 1024, 256),
          ("gpt2-124m T1024 B1", 12, 768, 1024, 50304)]


def products(n_layer, C, N, V):
    """(label, count per step, (M, K), (K, N) operand builders' shapes and layouts) of one step."""
    out = []
    for name, fin, fout in (("qkv", C, 3 * C), ("attn.c_proj", C, C), ("c_fc", C, 4 * C), ("mlp.c_proj", 4 * C, C)):
        out += [(f"{name} y=xW^T", n_layer, ("x", N, fin), ("wT", fout, fin)),
                (f"{name} dx=dyW", n_layer, ("x", N, fout), ("w", fout, fin)),
                (f"{name} dW=dy^Tx", n_layer, ("xT", N, fout), ("x", N, fin))]
    out += [("head logits", 1, ("x", N, C), ("wT", V, C)), ("head dh", 1, ("x", N, V), ("w", V, C)),
            ("head dW", 1, ("xT", N, V), ("x", N, C))]
    return out


def operand(np, rng, kind, r, c):
    """A (r, c) array; 'wT'/'xT' the transpose of a C-contiguous one, as pympar passes w.T / dy.T."""
    a = rng.standard_normal((r, c)).astype(np.float32)
    return a.T if kind in ("wT", "xT") else a


def one(threads, shapes, reps):
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import numpy as np
    import torch

    from pympar import kernels
    from pympar.kernels import gemm
    from pympar.nn.products import matmul
    torch.set_num_threads(threads)
    kernels.set_process_threads(threads)                 # as pympar.train sets them (cores.share_cores)
    rng = np.random.default_rng(0)
    settle = 0.3 if threads > 1 else 0.0
    rows = []
    for (label, L, C, N, V) in shapes:
        total = dict(numpy=0.0, pympar=0.0, torch=0.0)
        flops = 0.0
        parts = []
        for (name, count, (ka, ra, ca), (kb, rb, cb)) in products(L, C, N, V):
            a, b = operand(np, rng, ka, ra, ca), operand(np, rng, kb, rb, cb)
            assert a.shape[1] == b.shape[0], (name, a.shape, b.shape)
            out = np.empty((a.shape[0], b.shape[1]), np.float32)
            ta, tb, to = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(out)
            fns = dict(numpy=lambda: np.matmul(a, b, out=out),          # NumPy's BLAS
                       pympar=lambda: matmul(a, b, out=out),            # pympar's products (kernels/gemm.py)
                       torch=lambda: torch.matmul(ta, tb, out=to))
            t = {k: float("inf") for k in fns}
            for _ in range(2):                               # two rounds, the libraries alternating
                for k, fn in fns.items():
                    t[k] = min(t[k], best(fn, reps, settle=settle))
            fl = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            for k in total:
                total[k] += count * t[k]
            flops += count * fl
            parts.append(dict(product=name, count=count, shape=[a.shape[0], a.shape[1], b.shape[1]],
                              **{f"{k}_gflops": fl / t[k] / 1e9 for k in fns}))
        tn, tp, tt = total["numpy"], total["pympar"], total["torch"]
        rows.append(dict(shape=label, threads=threads, numpy_ms=1e3 * tn, pympar_ms=1e3 * tp, torch_ms=1e3 * tt,
                         numpy_gflops=flops / tn / 1e9, pympar_gflops=flops / tp / 1e9, torch_gflops=flops / tt / 1e9,
                         torch_over_numpy=tn / tt, torch_over_pympar=tp / tt, products=parts))
        print(f"{label:20s} {threads} thr: step GEMMs NumPy {1e3 * tn:7.1f} ms ({flops / tn / 1e9:4.0f} GFLOP/s), "
              f"pympar ({gemm.active()}) {1e3 * tp:7.1f} ms ({flops / tp / 1e9:4.0f}), torch {1e3 * tt:7.1f} ms "
              f"({flops / tt / 1e9:4.0f}): torch's BLAS {tn / tt:.2f}x NumPy's speed, {tp / tt:.2f}x pympar's",
              flush=True)
    return dict(blas_numpy=np.__version__, torch_version=torch.__version__, pympar_gemm=gemm.describe(), rows=rows)


def parse_shapes(text):
    if not text:
        return SHAPES
    out = []
    for s in text.split(","):
        L, C, N, V = s.lstrip("L").split(":")
        out.append((f"L{L} D{C} N{N} V{V}", int(L), int(C), int(N), int(V)))
    return out


def run(a):
    rows, meta = [], {}
    for t in a.threads:
        p = subprocess.run([sys.executable, __file__, "--one", str(t), "--reps", str(a.reps),
                            *(["--shapes", a.shapes] if a.shapes else [])],
                           capture_output=True, text=True, timeout=1800, cwd=ROOT)
        if p.returncode != 0:
            raise SystemExit(f"bench/gemm.py at {t} thread(s) failed:\n{p.stderr[-2000:]}")
        lines = p.stdout.splitlines()
        print("\n".join(lines[:-1]), flush=True)
        d = json.loads(lines[-1])
        rows += d.pop("rows")
        meta = d
    return dict(machine=machine(), reps=a.reps, **meta, rows=rows)


def plot(res, png):
    import numpy as np
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    rows = res["rows"]
    x = np.arange(len(rows))
    ax.bar(x - 0.27, [r["numpy_gflops"] for r in rows], width=0.27, label="NumPy's BLAS")
    ax.bar(x, [r.get("pympar_gflops", 0) for r in rows], width=0.27, label=f"pympar ({res.get('pympar_gemm', '?')})")
    ax.bar(x + 0.27, [r["torch_gflops"] for r in rows], width=0.27, label="PyTorch's BLAS")
    ax.set_xticks(x, [f"{r['shape']}\n{r['threads']} thr" for r in rows], fontsize=6)
    ax.set(ylabel="GFLOP/s over the step's GEMMs", title="the GEMMs of a training step, float32")
    ax.legend(fontsize=7)
    fig.suptitle(res["machine"], fontsize=7)
    save(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=7, help="calls per product and library (the best is kept)")
    ap.add_argument("--shapes", default="", help="comma-separated L:C:tokens:vocab (default: train_step's three)")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)   # internal: one thread count, JSON out
    argv = sys.argv[1:] if argv is None else argv
    if "--one" in argv:
        a = ap.parse_args(argv)
        print(json.dumps(one(a.one, parse_shapes(a.shapes), a.reps)))
        return None
    return run_and_write(ap, argv, "gemm", run, plot)


if __name__ == "__main__":
    main()
