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
_bf16_blocks = getattr(_C, "gemm_bf16", None)  # the bf16 driver (tiles, epilogue) on the same threads

CHOICES = ("auto", "numpy", "mkl")

_choice = "auto"
_lib = None          # None: not looked for yet; False: not found; else the CDLL
_where = ""          # the library's path (or the reason it is missing)
_fn = {}             # dtype -> cblas_sgemm / cblas_dgemm (ctypes)
_addr = {}           # dtype -> the same function's address (for _C.gemm_blocks)
_bf = {}             # MKL's bf16 GEMM: "gemm", "compute" (addresses), "pack", "pack_size" (ctypes)

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
        _bind_bf16(lib)
        _lib, _where = lib, path
        return _lib
    _lib = False
    _where = ("libmkl_rt not found (looked in " + os.path.join(sys.prefix, "lib") +
              " and the loader's path): pip install mkl, or PYMPAR_GEMM=numpy")
    return _lib


def _bind_bf16(lib):
    """MKL's bf16 x bf16 -> float32 GEMM and its packed-operand API, where this MKL has them (2020+).
    MKL runs it on AMX tiles where the CPU has them, else AVX512-BF16, else emulated in float32."""
    names = ("cblas_gemm_bf16bf16f32", "cblas_gemm_bf16bf16f32_compute", "cblas_gemm_bf16bf16f32_pack",
             "cblas_gemm_bf16bf16f32_pack_get_size")
    if not all(hasattr(lib, n) for n in names):
        return
    i, p = ctypes.c_int, ctypes.c_void_p
    pack, size = lib.cblas_gemm_bf16bf16f32_pack, lib.cblas_gemm_bf16bf16f32_pack_get_size
    pack.argtypes, pack.restype = (i, i, i, i, i, i, p, i, p), None
    size.argtypes, size.restype = (i, i, i, i), ctypes.c_size_t
    _bf.update(gemm=ctypes.cast(lib.cblas_gemm_bf16bf16f32, p).value,
               compute=ctypes.cast(lib.cblas_gemm_bf16bf16f32_compute, p).value, pack=pack, pack_size=size)


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


def gemm_address(dtype):
    """The address of MKL's sequential cblas_sgemm/dgemm for ``dtype`` when MKL is selected (for C++
    callers that run many small products themselves: nn.moe's grouped experts), else None."""
    if _choice == "numpy" or not _load():
        return None
    return _addr.get(np.dtype(dtype))


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


# --- bfloat16 products: bf16 operands, float32 accumulation ---------------------------------------
# Engines, chosen by CPU feature at run time (``bf16_engine``):
#   "amx"  pympar's own kernel on AMX tiles (csrc/amx.cpp), where the CPU has AMX-BF16 and the AVX-512
#          kernels are in use;
#   "avx512bf16"  pympar's own kernel on AVX512-BF16 dot products (VDPBF16PS; the same packs, blocking
#          and epilogue as "amx"), where the CPU has AVX512-BF16 but no AMX (AMD Zen 4 and later, Intel
#          Cooper Lake) and the AVX-512 kernels are in use;
#   "mkl"  MKL's cblas_gemm_bf16bf16f32 (AMX or AVX512-BF16 inside MKL), where MKL is selected and the
#          CPU multiplies bf16 natively (avx512_bf16 or AMX): chosen only by name. On an AMD EPYC with
#          AVX512-BF16 it ran at 93-99 GFLOP/s per thread against 94-102 for MKL's own sgemm, and a
#          bf16 step took longer than a float32 one (docs/precision.md);
#   None   no native bf16 products: the operands are widened to float32 and multiplied there (the
#          caller's fallback; --dtype auto picks float32 on such a CPU).
# "auto" takes "amx", else "avx512bf16", else None. PYMPAR_BF16_GEMM=auto|amx|avx512bf16|mkl|float32
# (pympar.config) forces one (the named engines fail where they cannot run).
BF16_CHOICES = ("auto", "amx", "avx512bf16", "mkl", "float32")
OWN_BF16 = ("amx", "avx512bf16")     # pympar's kernels: one pack format (_C.amx_pack_b), one driver
_bf16_choice = "auto"
_B_MATRIX, _PACKED = 162, 151        # MKL: CBLAS_IDENTIFIER CblasBMatrix, the "packed" transpose flag


def cpu_features() -> dict:
    """{avx2, avx512f, avx512bf16, amx_bf16: bool} of this CPU (empty without the C++ module)."""
    return dict(_C.cpu_features()) if _C is not None else {}


def _native_bf16_cpu() -> bool:
    f = cpu_features()
    return bool(f.get("avx512bf16") or f.get("amx_bf16"))


def _avx512_kernels() -> bool:
    """The AVX-512 build of the C++ kernels is the one in use (PYMPAR_ISA=avx2/generic turns it off,
    and with it the native bf16 products: that machine is then simulated whole)."""
    return _C is not None and _C.isa() == "avx512"


def _engine(choice):
    amx = _avx512_kernels() and bool(_C.amx_available())
    dp = _avx512_kernels() and bool(_C.dp_bf16_available())
    mkl = bool(_load()) and bool(_bf) and _bf16_blocks is not None and _choice != "numpy"
    if choice == "amx":
        return "amx" if amx else None
    if choice == "avx512bf16":
        return "avx512bf16" if dp else None
    if choice == "mkl":
        return "mkl" if mkl and _avx512_kernels() and _native_bf16_cpu() else None
    if choice == "auto":
        return "amx" if amx else ("avx512bf16" if dp else None)
    return None


def use_bf16(choice: str) -> None:
    """Select the bf16 product engine: "auto", "amx", "avx512bf16", "mkl" or "float32" (ValueError for
    another name, or for an engine this machine cannot run)."""
    global _bf16_choice
    if choice not in BF16_CHOICES:
        raise ValueError(f"bf16 GEMM {choice!r}: expected one of {', '.join(BF16_CHOICES)}")
    if choice in ("amx", "avx512bf16", "mkl") and _engine(choice) is None:
        raise ValueError(f"bf16 GEMM {choice!r} cannot run here (CPU features {cpu_features()}, "
                         f"C++ kernels {_C.isa() if _C is not None else 'missing'}, MKL: {active() == 'mkl'})")
    _bf16_choice = choice


def bf16_engine():
    """"amx", "avx512bf16", "mkl", or None (bf16 products widened to float32) under the current selection."""
    return _engine(_bf16_choice)


def bf16_native() -> bool:
    """Whether bf16 products run natively here (what --dtype auto asks)."""
    return bf16_engine() is not None


def describe_bf16() -> str:
    """One line for a start-up banner: what multiplies bf16 here."""
    e = bf16_engine()
    if e == "amx":
        return "AMX tiles (pympar's kernel)"
    if e == "avx512bf16":
        return "AVX512-BF16 dot products (pympar's kernel)"
    if e == "mkl":
        f = cpu_features()
        return "MKL cblas_gemm_bf16bf16f32 (" + ("AMX" if f.get("amx_bf16") else "AVX512-BF16") + ")"
    return "emulated (widened to float32, products rounded to bf16)"


def bf16_available() -> bool:
    return bf16_engine() is not None


class _Packs:
    """Right-hand operands packed once: a weight's bf16 copy, registered by ``packable``, is packed the
    first time a product reads it (as W or as W.T: two packs, in the engine's format: MKL's
    cblas_gemm_bf16bf16f32_pack, or pympar's AMX panels) and reused until the copy is let go -- once
    per optimizer step, not per micro-batch, and not once per tile of rows. Keyed by the array's id
    while a weak reference says it lives."""

    def __init__(self):
        self._arrays = {}                # id(base) -> (weakref to base, {(engine, trans): packed buffer})

    def register(self, w):
        import weakref
        key = id(w)
        self._arrays[key] = (weakref.ref(w, lambda _r, k=key: self._arrays.pop(k, None)), {})

    def get(self, b, engine):
        """The packed buffer of b (K, N) when b is a registered array or its transpose, else None."""
        base = b if b.base is None else b.base
        entry = self._arrays.get(id(base))
        if entry is None or entry[0]() is not base or base.ndim != 2 or not base.flags.c_contiguous:
            return None
        if b.shape == base.shape and b.strides == base.strides:
            trans = _NO_TRANS
        elif b.shape == base.shape[::-1] and b.strides == base.strides[::-1]:
            trans = _TRANS
        else:
            return None
        buf = entry[1].get((engine, trans))
        if buf is None:
            K, N = b.shape
            if max(K, N) > _INT_MAX:
                return None
            if engine in OWN_BF16:                   # tiles load 64-byte rows: the pack starts on a line
                buf = aligned_empty(int(_C.amx_packed_b_size(K, N)), np.uint16)
                _C.amx_pack_b(b.ctypes.data, b.strides[0] // 2, b.strides[1] // 2, K, N, buf)
            else:
                buf = np.empty(int(_bf["pack_size"](_B_MATRIX, 1, N, K)), np.uint8)
                _bf["pack"](_ROW_MAJOR, _B_MATRIX, trans, 1, N, K, base.ctypes.data, base.shape[1], buf.ctypes.data)
            entry[1][(engine, trans)] = buf
        return buf


_packs = _Packs()


def aligned_empty(n: int, dtype, align: int = 64):
    """An uninitialised 1-D array of n elements whose data starts on an ``align``-byte boundary."""
    item = np.dtype(dtype).itemsize
    raw = np.empty(n + align // item, dtype)
    off = (-raw.ctypes.data % align) // item
    return raw[off:off + n]


def bf16_pack(b):
    """The pack products on the bf16 engine use for b (a registered weight copy or its transpose,
    ``packable``), else None: for C++ callers that run the products themselves (nn.moe's grouped
    experts), so that they read the same operand the per-call path reads."""
    engine = bf16_engine()
    return None if engine is None else _packs.get(b, engine)


def packable(w) -> None:
    """Register w, a C-contiguous 2-D bf16 array that stays unchanged while it lives (a weight's
    compute copy), so that products reading it as their right-hand operand (w or w.T) use one pack of
    it instead of packing it in every call."""
    if bf16_engine() is not None and w.ndim == 2 and w.flags.c_contiguous:
        _packs.register(w)


def product_bf16(a, b, out=None, threads: int = 1, accumulate: bool = False, bias=None, gelu_out=None):
    """a @ b for bfloat16 a (M, K) and b (K, N), float32 accumulation, on the bf16 engine (None:
    nothing written, the caller takes another path). ``out`` float32: the product written or,
    ``accumulate``, added (beta = 1). ``out`` bfloat16 (or None: a new bf16 array):
    round(a @ b + bias), bias float32 (N,) or None, and with ``gelu_out`` (bf16, like out) also
    round(GELU(out)). out (and gelu_out) row-major with unit stride, sharing no memory with a or b.
    Returns out, or None."""
    engine = bf16_engine()
    if engine is None or a.ndim != 2 or b.ndim != 2:
        return None
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K or min(M, N, K) < 1 or max(M, N, K) > _INT_MAX:
        return None
    if a.dtype.name != "bfloat16" or b.dtype.name != "bfloat16":
        return None
    c_bf16 = out is None or out.dtype.name == "bfloat16"
    if out is None:
        out = np.empty((M, N), a.dtype)
    elif not _row_major_out(out, (M, N), a, b):
        return None
    if c_bf16:
        if accumulate:
            return None
        if bias is not None and not (bias.dtype == np.float32 and bias.shape == (N,) and bias.flags.c_contiguous):
            return None
        if gelu_out is not None and not _row_major_out(gelu_out, (M, N), a, b, out.dtype):
            return None
    elif out.dtype != np.float32 or bias is not None or gelu_out is not None:
        return None
    packed = _packs.get(b, engine)
    ldc = out.strides[0] // out.itemsize
    pbias = 0 if bias is None else bias.ctypes.data
    pg, ldg = (0, 0) if gelu_out is None else (gelu_out.ctypes.data, gelu_out.strides[0] // gelu_out.itemsize)
    if engine in OWN_BF16:                           # any element strides: the kernel packs what it reads
        if any(s % 2 for s in (*a.strides, *b.strides)):
            return None
        _C.amx_gemm(a.ctypes.data, a.strides[0] // 2, a.strides[1] // 2,
                    packed.ctypes.data if packed is not None else b.ctypes.data,
                    b.strides[0] // 2, b.strides[1] // 2, packed is not None, M, N, K,
                    out.ctypes.data, ldc, c_bf16, accumulate, pbias, pg, ldg, engine == "amx")
        return out
    la = _operand(a)
    lb = (_NO_TRANS, N) if packed is not None else _operand(b)
    if la is None or lb is None:
        return None
    (ta, lda), (tb, ldb) = la, lb
    parts = max(1, min(int(threads), M // 16)) if 2.0 * M * N * K >= _SPLIT_FLOPS else 1
    _bf16_blocks(_bf["compute"] if packed is not None else _bf["gemm"], packed is not None, ta, tb, M, N, K,
                 a.ctypes.data, lda, packed.ctypes.data if packed is not None else b.ctypes.data, ldb,
                 1.0 if accumulate else 0.0, out.ctypes.data, ldc, c_bf16, pbias, pg, ldg, parts)
    return out


def _row_major_out(out, shape, a, b, dtype=None) -> bool:
    """out may take the product: its shape (and dtype), unit stride along rows, no memory shared with a or b."""
    item = out.itemsize
    return (out.shape == shape and (dtype is None or out.dtype == dtype) and out.strides[1] == item
            and out.strides[0] % item == 0 and out.strides[0] // item >= shape[1]
            and not np.may_share_memory(out, a) and not np.may_share_memory(out, b))
