"""Each C++ kernel against the NumPy expression it replaces (pympar.kernels.reference), at 1M+
elements and at a small size, with 1 and 2 threads. Prints a table with the speedup ratio
(reference time / native time) and writes JSON with --json.

    PYTHONPATH=. python bench/cpu_kernels.py                 # float32, sizes 1M and 16K, threads 1,2
    PYTHONPATH=. python bench/cpu_kernels.py --dtype float64 --threads 1 2 4 --json out.json

The reference runs single-threaded NumPy (its expressions do not use threads); OMP/BLAS
threads are pinned to 1 so that the only parallelism measured is the kernels' own.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from pympar import backend  # noqa: E402
from pympar import kernels as K  # noqa: E402
from pympar.kernels import native, reference as R  # noqa: E402
from pympar.config import apply_environment  # noqa: E402

apply_environment()          # as an application does first: PYMPAR_* settings (PYMPAR_ISA)


def timeit(fn, min_time=0.2):
    """Fastest single call (seconds) among the calls made in about min_time.

    The minimum, not the mean: on a shared machine the other processes only ever add time."""
    fn()  # warm-up (first-touch of outputs, caches)
    best, spent, calls = float("inf"), 0.0, 0
    while spent < min_time or calls < 5:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return best


def cases(n, dt, rng):
    """(name, elements, reference call, native call) for about n elements per operand."""
    f = lambda *s: rng.standard_normal(s).astype(dt)  # noqa: E731
    C = 768
    N = max(1, n // C)
    x, w, b = f(N, C), f(C), f(C)
    y, mean, rstd = R.layernorm_forward(x, w, b)
    dy = f(N, C)
    T = max(2, int(round((n / 8) ** 0.5)))
    att = f(8, T, T)
    p_att = R.softmax_causal_forward(att)
    V = 4096
    NV = max(1, n // V)
    logits, tgt = f(NV, V), rng.integers(0, V, NV)
    loss, lse = R.cross_entropy_forward(logits, tgt)
    g = f(n)
    ad = [f(n), f(n) * 0.1, np.abs(f(n)) * 0.01]
    ad_ref = [a.copy() for a in ad]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10)
    red = [f(n), f(n)]
    lo = backend.bfloat16
    red_bf = [red[0].astype(lo), red[1].astype(lo)]
    flat = f(n)
    E, k = 64, 2
    scores = f(max(1, n // E), E)
    xs = f(N, C)
    rows = rng.permutation(N)
    out = [
        ("layernorm_fwd", x.size, lambda: R.layernorm_forward(x, w, b), lambda: native.layernorm_forward(x, w, b)),
        ("layernorm_bwd", x.size, lambda: R.layernorm_backward(dy, x, w, mean, rstd),
         lambda: native.layernorm_backward(dy, x, w, mean, rstd)),
        ("gelu_fwd", flat.size, lambda: R.gelu_forward(flat), lambda: native.gelu_forward(flat)),
        ("gelu_bwd", flat.size, lambda: R.gelu_backward(flat, g), lambda: native.gelu_backward(flat, g)),
        ("softmax_causal_fwd", att.size, lambda: R.softmax_causal_forward(att),
         lambda: native.softmax_causal_forward(att)),
        ("softmax_causal_bwd", att.size, lambda: R.softmax_causal_backward(p_att, att),
         lambda: native.softmax_causal_backward(p_att, att)),
        ("cross_entropy_fwd", logits.size, lambda: R.cross_entropy_forward(logits, tgt),
         lambda: native.cross_entropy_forward(logits, tgt)),
        ("cross_entropy_bwd", logits.size, lambda: R.cross_entropy_backward(logits, lse, tgt, 1.0 / NV),
         lambda: native.cross_entropy_backward(logits, lse, tgt, 1.0 / NV)),
        ("adamw", n, lambda: R.adamw_step(*ad_ref[:1], g, *ad_ref[1:], **kw),
         lambda: native.adamw_step(ad[0], g, ad[1], ad[2], **kw)),
        ("reduce_sum", n, lambda: R.reduce_inplace(red[0], red[1], "sum"),
         lambda: native.reduce_inplace(red[0], red[1], "sum")),
        ("reduce_max", n, lambda: R.reduce_inplace(red[0], red[1], "max"),
         lambda: native.reduce_inplace(red[0], red[1], "max")),
        ("scale", n, lambda: R.scale_inplace(red[1], 1.0), lambda: native.scale_inplace(red[1], 1.0)),
        ("topk(E=64,k=2)", scores.size, lambda: R.topk(scores, k), lambda: native.topk(scores, k)),
        ("permute", xs.size, lambda: R.permute(xs, rows), lambda: native.permute(xs, rows)),
        ("unpermute_add", xs.size, lambda: R.unpermute_add(xs, rows, None, N),
         lambda: native.unpermute_add(xs, rows, None, N)),
    ]
    if dt == np.float32:
        out += [
            ("reduce_sum_bf16", n, lambda: R.reduce_inplace(red_bf[0], red_bf[1], "sum"),
             lambda: native.reduce_inplace(red_bf[0], red_bf[1], "sum")),
            ("cast_f32_bf16", n, lambda: R.cast(flat, lo), lambda: native.cast(flat, lo)),
            ("cast_f32_f16", n, lambda: R.cast(flat, np.float16), lambda: native.cast(flat, np.float16)),
        ]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 14])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per timing")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not K.native_available():
        sys.exit("pympar._C is not built: pip install . (or pip install -e . in a checkout) first")
    dt = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    rows = []
    head = f"{'kernel':<20} {'elements':>9} {'numpy ms':>9}" + "".join(
        f" {f'{t}T ms':>8} {f'{t}T x':>6}" for t in args.threads)
    print(f"pympar C++ kernels ({K.native_isa()}) vs the NumPy reference, {args.dtype}")
    print(head)
    print("-" * len(head))
    for n in args.sizes:
        for name, elems, ref, nat in cases(n, dt, rng):
            t_ref = timeit(ref, args.min_time)
            row = {"kernel": name, "elements": int(elems), "dtype": args.dtype, "numpy_s": t_ref, "native": {}}
            line = f"{name:<20} {elems:>9} {t_ref * 1e3:>9.3f}"
            for th in args.threads:
                K.set_num_threads(th)
                t = timeit(nat, args.min_time)
                row["native"][str(th)] = {"seconds": t, "speedup": t_ref / t}
                line += f" {t * 1e3:>8.3f} {t_ref / t:>6.1f}"
            K.set_num_threads(1)
            rows.append(row)
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"isa": K.native_isa(), "dtype": args.dtype, "threads": args.threads,
                       "cpu_count": os.cpu_count(), "results": rows}, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
