"""The BLAS under NumPy: its thread count, who runs its threads, and running small GEMMs on
several threads at once.

Who owns the cores: OpenBLAS keeps a thread pool of its own whose idle threads spin (for about
0.1 s after each threaded call), beside the C++ kernels' pool. At 2 threads on 2 cores the two
pools took turns stealing each other's core (a layernorm backward no faster at 2 threads than
at 1). ``share_kernel_threads(n)`` hands OpenBLAS's parallel jobs to the kernels' pool instead
(OpenBLAS's caller-managed threading hook, OpenBLAS >= 0.3.27), so the same n threads run every
GEMM and kernel of a step. OpenBLAS splits the work exactly as with its own threads: the numbers
are the same, bit for bit. ``PYMPAR_BLAS_THREADS=own`` opts out.

Why: OpenBLAS splits each GEMM over its threads. That pays for the big token-by-feature
GEMMs, but attention's stacks of per-head GEMMs (B*nh matrices of T x T x hs) gain nothing
from it (measured: 1.00x at 2 threads on the small preset). ``over_chunks`` instead hands
whole slices of such a stack to ``n`` Python threads (NumPy drops the GIL inside matmul and
the C++ kernels drop it too), with the BLAS set to one thread meanwhile, so the slices run
side by side and each matrix is computed exactly as before (bit-identical results).

The BLAS is found among the loaded libraries (OpenBLAS under its plain or scipy-openblas
names, Linux); where none is found, ``blas_threads()`` is None and ``over_chunks`` runs
serially.
"""
from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
            "openblas_set_num_threads64_", "scipy_openblas_set_num_threads")
_GETTERS = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
            "openblas_get_num_threads64_", "scipy_openblas_get_num_threads")
_HOOKS = ("openblas_set_threads_callback_function", "scipy_openblas_set_threads_callback_function64_",
          "openblas_set_threads_callback_function64_", "scipy_openblas_set_threads_callback_function")

try:
    from .. import _C
except ImportError:  # no native build: OpenBLAS keeps its own threads, chunks run on Python threads
    _C = None

_api = None  # None: not looked up yet; () none found; else [(set, get), ...]
_hooks = ()  # each loaded OpenBLAS's set_threads_callback_function (those that have one)
_shared = False  # True once the BLAS runs its jobs on the kernels' threads
_pool = None
_pool_n = 0
_lock = threading.Lock()


def _openblas():
    global _api, _hooks
    if _api is not None:
        return _api
    import numpy  # noqa: F401  (loads the BLAS this process's NumPy uses)

    found, seen, hooks = [], set(), []
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for s, g in zip(_SETTERS, _GETTERS):
            if hasattr(lib, s) and hasattr(lib, g) and (path, s) not in seen:
                seen.add((path, s))
                setter, getter = getattr(lib, s), getattr(lib, g)
                setter.argtypes, setter.restype, getter.restype = (ctypes.c_int,), None, ctypes.c_int
                found.append((setter, getter))
                hook = next((getattr(lib, h) for h in _HOOKS if hasattr(lib, h)), None)
                if hook is not None:
                    hook.argtypes, hook.restype = (ctypes.c_void_p,), None
                    hooks.append(hook)
                break
    _api = tuple(found)
    _hooks = tuple(hooks) if len(hooks) == len(found) else ()   # all or none
    return _api


def blas_threads():
    """The BLAS's thread count, or None when no OpenBLAS was found in this process."""
    api = _openblas()
    return api[0][1]() if api else None


def set_blas_threads(n: int) -> bool:
    """Set every loaded OpenBLAS to ``n`` threads; False when none was found."""
    api = _openblas()
    for setter, _ in api:
        setter(int(n))
    return bool(api)


_allowed = {"share": True, "chunks": True}


def configure(*, share_threads: bool = True, chunk_threads: bool = True) -> None:
    """share_threads=False: OpenBLAS keeps its own threads (``share_kernel_threads`` declines);
    chunk_threads=False: ``over_chunks`` runs its ranges in one call, serially. The edge
    (pympar.config) sets them from PYMPAR_BLAS_THREADS=own and PYMPAR_CHUNK_THREADS=0."""
    _allowed.update(share=bool(share_threads), chunks=bool(chunk_threads))


def share_kernel_threads(n: int) -> bool:
    """Run the BLAS's parallel jobs on the C++ kernels' pool and give it ``n`` threads (the
    pool's size). False, and nothing changed, when the native kernels, an OpenBLAS with the
    threading hook, or the consent (``configure(share_threads=False)`` opts out) is missing."""
    global _shared
    if _C is None or not _allowed["share"] or not _openblas() \
            or not _hooks:
        return False
    if not _shared:
        for hook in _hooks:
            hook(_C.blas_threads_callback())
        _shared = True
    set_blas_threads(n)
    return True


def kernel_threads_shared() -> bool:
    """True when the BLAS runs its parallel jobs on the kernels' threads (share_kernel_threads)."""
    return _shared


def _executor(n):
    global _pool, _pool_n
    if _pool is None or _pool_n != n:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool, _pool_n = ThreadPoolExecutor(n, thread_name_prefix="pympar-chunk"), n
    return _pool


def balanced_bounds(weights, parts: int) -> list:
    """Bounds b[0]=0 <= ... <= b[parts]=len(weights) cutting the items, in order, into ``parts``
    contiguous ranges of about equal total weight (range j ends at the first item whose running
    total reaches j/parts of the whole)."""
    n = len(weights)
    total = float(sum(weights))
    if total <= 0:
        return [n * j // parts for j in range(parts + 1)]
    bounds, run, j = [0], 0.0, 1
    for i, w in enumerate(weights):
        run += w
        while j < parts and run >= total * j / parts:
            bounds.append(i + 1)
            j += 1
    bounds += [n] * (parts + 1 - len(bounds))
    return bounds


def over_chunks(n_items: int, fn, n_threads: int, weights=None) -> None:
    """Call ``fn(i0, i1)`` on ``min(n_threads, n_items)`` disjoint ranges covering [0, n_items):
    side by side with the BLAS at one thread when n_threads > 1 and the BLAS can be set, else
    once serially (fn(0, n_items)). ``fn`` must write disjoint outputs per range. ``weights``
    (one per item, e.g. an MoE expert's rows): ranges of about equal weight instead of equal
    item counts (balanced_bounds).

    The ranges run on the C++ kernels' own threads when they are built (at most the pool's size
    at once; kernels called inside a range then run on that range's thread alone, so no third
    thread competes for the cores), else on a Python thread pool."""
    parts = min(int(n_threads), int(n_items))
    if parts <= 1 or not _allowed["chunks"] or not _openblas() \
            or not _lock.acquire(blocking=False):   # nested or concurrent use: serial
        fn(0, n_items)
        return
    if weights is not None:                   # one item per range, cut by weight
        b = balanced_bounds(weights, parts)
        run, n_items = fn, parts

        def fn(i0, i1):
            for j in range(i0, i1):
                if b[j] < b[j + 1]:
                    run(b[j], b[j + 1])
    try:
        before = blas_threads()
        set_blas_threads(1)
        try:
            if _C is not None:
                _C.parallel_chunks(int(n_items), parts, fn)
                return
            bounds = [n_items * i // parts for i in range(parts + 1)]
            futs = [_executor(parts).submit(fn, bounds[i], bounds[i + 1]) for i in range(1, parts)]
            fn(bounds[0], bounds[1])          # the caller takes the first range
            for f in futs:
                f.result()
        finally:
            set_blas_threads(before)
    finally:
        _lock.release()
