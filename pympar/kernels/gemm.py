"""Which library multiplies pympar's float32/float64 matrices on NumPy: NumPy's own BLAS
(OpenBLAS in the NumPy wheels) or Intel oneMKL's ``cblas_?gemm`` when it is installed.

Why: a training step on a CPU spends about three quarters of its time in the Linear layers'
GEMMs (bench/gemm.py). On this project's machines MKL's single-thread sgemm took 1.12-1.15x
less time than OpenBLAS's over a step's products (docs/engine.md, "GEMM library"); PyTorch's
CPU wheels call MKL too, so with NumPy's BLAS alone pympar's step lost that much to PyTorch's
before any of its own work counted.

Selection (``use``): "auto" (the default) takes MKL where ``libmkl_rt`` is found (the ``mkl``
wheel, ``pip install "pympar[mkl]"``, installs it beside the interpreter: ``sys.prefix/lib``;
else the dynamic loader's search path), else NumPy's BLAS; "mkl" insists (an error naming what
was looked for when it is missing); "numpy" keeps NumPy's BLAS. The edge (pympar.config) sets it
from ``PYMPAR_GEMM``.

What MKL runs: 2-D float32/float64 products whose operands are each row- or column-major with
unit stride (a transposed view such as ``w.T`` is column-major: MKL reads it as ``Trans``), and
whose output is row-major with unit stride (a block of rows of a larger array is fine) and
shares no memory with either operand. Anything else (stacks of matrices, other strides, other
dtypes, empty or one-wide products) goes to NumPy's matmul, as before.

Threads: MKL runs sequentially (its own OpenMP threads would spin beside the C++ kernels'
pool: blas.py says why that costs); at n > 1 kernel threads a product is cut into n blocks of
output rows (of output columns when it is wider than tall), each one sequential MKL call on one
of the kernels' threads, so the same n threads run every GEMM and kernel of a step, as with
OpenBLAS's shared pool. The C++ module calls the blocks (``_C.gemm_blocks``: MKL's function by
its address, the GIL released): measured alone at 2 threads, a 1024x256x256 product took 411 us
against 590 with a Python call per block through blas.over_chunks (which remains the path
without the module) and 811 at 1 thread.

Other MKLs in the process: libmkl_rt opens MKL's layers into the process's global symbol scope at
the first product. A library loaded after that which carries its own MKL with exported symbols
(PyTorch's CPU wheel does) then binds its MKL calls to these, sequential ones: measured,
PyTorch's 2-thread training step 1.5x slower (L4 D256, bench/train_step.py). Loaded before, it
keeps its own (its symbols are bound when it loads, and it is not in the global scope). So a
program that uses PyTorch beside pympar imports torch first (the benchmarks do), or sets
PYMPAR_GEMM=numpy.

Numbers: MKL and OpenBLAS round differently (float32 products agree to a few ulps of the sum's
magnitude, not bit for bit); within one library, the same product on the same threads gives
the same bits, so a run is reproducible under one selection. Every rank of a job should use the
same library (the start-up line names it).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import numpy as np

from .blas import _C, over_chunks

_blocks = getattr(_C, "gemm_blocks", None)   # runs a product's blocks on the kernel threads, no GIL

CHOICES = ("auto", "numpy", "mkl")

_choice = "auto"
_lib = None          # None: not looked for yet; False: not found; else the CDLL
_where = ""          # the library's path (or the reason it is missing)
_fn = {}             # dtype -> cblas_sgemm / cblas_dgemm (ctypes)
_addr = {}           # dtype -> the same function's address (for _C.gemm_blocks)

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_SEQUENTIAL = 1      # MKL_THREADING_SEQUENTIAL (mkl_service.h)
_INT_MAX = 2 ** 31 - 1
# products smaller than this (2 M K N FLOPs) are not cut over threads: a block's dispatch
# (a few microseconds) would be a large part of it
_SPLIT_FLOPS = 2 * 128 * 128 * 128


def candidates():
    """Where libmkl_rt is looked for, in order: beside this interpreter (the mkl wheel's
    place), then the dynamic loader's own search (LD_LIBRARY_PATH, ldconfig)."""
    out = []
    for d in dict.fromkeys((os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib"))):
        for name in ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"):
            p = os.path.join(d, name)
            if os.path.exists(p):
                out.append(p)
    found = ctypes.util.find_library("mkl_rt")
    if found:
        out.append(found)
    return out


def _load():
    global _lib, _where
    if _lib is not None:
        return _lib
    tried = candidates()
    for path in tried:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if not (hasattr(lib, "cblas_sgemm") and hasattr(lib, "MKL_Set_Threading_Layer")):
            continue
        lib.MKL_Set_Threading_Layer.argtypes, lib.MKL_Set_Threading_Layer.restype = (ctypes.c_int,), ctypes.c_int
        lib.MKL_Set_Threading_Layer(_SEQUENTIAL)        # before any other call: no OpenMP threads
        for dtype, name, real in ((np.float32, "cblas_sgemm", ctypes.c_float),
                                  (np.float64, "cblas_dgemm", ctypes.c_double)):
            f = getattr(lib, name)
            i, p = ctypes.c_int, ctypes.c_void_p
            f.argtypes = (i, i, i, i, i, i, real, p, i, p, i, real, p, i)
            f.restype = None
            _fn[np.dtype(dtype)] = f
            _addr[np.dtype(dtype)] = ctypes.cast(f, ctypes.c_void_p).value
        _lib, _where = lib, path
        return _lib
    _lib = False
    _where = ("libmkl_rt not found (looked in " + os.path.join(sys.prefix, "lib") +
              " and the loader's path): pip install mkl, or PYMPAR_GEMM=numpy")
    return _lib


def use(choice: str) -> None:
    """Select the GEMM library: "auto", "numpy" or "mkl" (ValueError otherwise; "mkl" raises
    when MKL cannot be loaded)."""
    global _choice
    if choice not in CHOICES:
        raise ValueError(f"GEMM library {choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "mkl" and not _load():
        raise ValueError(f"GEMM library 'mkl': {_where}")
    _choice = choice


def active() -> str:
    """The library pympar's float32/float64 NumPy products run on now: "mkl" or "numpy"."""
    if _choice == "numpy":
        return "numpy"
    return "mkl" if _load() else "numpy"


def describe() -> str:
    """One line for a start-up banner: the library and where it came from."""
    if active() == "mkl":
        return f"MKL ({os.path.basename(_where)})"
    return "NumPy's BLAS" + (" (PYMPAR_GEMM=numpy)" if _choice == "numpy" else " (no MKL found)")


def _operand(x):
    """(trans flag, leading dimension) of a 2-D operand MKL can read as it lies, else None."""
    item = x.itemsize
    s0, s1 = x.strides
    r, c = x.shape
    if s1 == item and s0 % item == 0 and s0 // item >= c:
        return _NO_TRANS, s0 // item
    if s0 == item and s1 % item == 0 and s1 // item >= r:
        return _TRANS, s1 // item
    return None


def product(a, b, out=None, threads: int = 1, accumulate: bool = False):
    """a @ b on MKL when it is selected and the layouts allow (the module's docstring), written
    into ``out`` when given (else into a fresh row-major array), or added to it (``accumulate``:
    out += a @ b in the GEMM itself, beta = 1, no temporary); returns ``out``, or None (nothing
    written) when the caller should use NumPy's matmul."""
    if accumulate and out is None:
        raise ValueError("gemm.product: accumulate=True needs an out to add the product to")
    if _choice == "numpy" or not _load():
        return None
    if a.ndim != 2 or b.ndim != 2:
        return None
    dt = a.dtype
    f = _fn.get(dt)
    if f is None or b.dtype != dt:
        return None
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K or min(M, N, K) < 2 or max(M, N, K) > _INT_MAX:
        return None
    la, lb = _operand(a), _operand(b)
    if la is None or lb is None:
        return None
    if out is None:
        out = np.empty((M, N), dt)
    else:
        item = out.itemsize
        if out.dtype != dt or out.shape != (M, N) or out.strides[1] != item or out.strides[0] % item \
                or out.strides[0] // item < N or np.may_share_memory(out, a) or np.may_share_memory(out, b):
            return None
    (ta, lda), (tb, ldb), ldc = la, lb, out.strides[0] // out.itemsize
    beta = 1.0 if accumulate else 0.0
    pa, pb, po = a.ctypes.data, b.ctypes.data, out.ctypes.data
    by_cols = N > M                              # wider than tall: blocks of output columns, else rows
    n = N if by_cols else M
    parts = max(1, min(int(threads), n // 16)) if 2.0 * M * N * K >= _SPLIT_FLOPS else 1
    # bytes from one block unit (a row, or a column) of a, b and out to the next
    da, db, do = (0, b.strides[1], out.strides[1]) if by_cols else (a.strides[0], 0, out.strides[0])
    if _blocks is not None:                      # the blocks on the kernel threads, without the GIL
        _blocks(_addr[dt], dt == np.float64, ta, tb, M, N, K, pa, lda, pb, ldb, beta, po, ldc, by_cols,
                da, db, do, parts)
        return out

    def block(i0, i1):                           # output rows (or columns) [i0, i1); one part: all
        m, w = (M, i1 - i0) if by_cols else (i1 - i0, N)
        f(_ROW_MAJOR, ta, tb, m, w, K, 1.0, pa + i0 * da, lda, pb + i0 * db, ldb, beta, po + i0 * do, ldc)

    over_chunks(n, block, parts)
    return out
