"""The BLAS under NumPy: its thread count, and running small GEMMs on several threads at once.

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
import os
import threading
from concurrent.futures import ThreadPoolExecutor

_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
            "openblas_set_num_threads64_", "scipy_openblas_set_num_threads")
_GETTERS = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
            "openblas_get_num_threads64_", "scipy_openblas_get_num_threads")

_api = None  # None: not looked up yet; () none found; else [(set, get), ...]
_pool = None
_pool_n = 0
_lock = threading.Lock()


def _openblas():
    global _api
    if _api is not None:
        return _api
    import numpy  # noqa: F401  (loads the BLAS this process's NumPy uses)

    found, seen = [], set()
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
                break
    _api = tuple(found)
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


def _executor(n):
    global _pool, _pool_n
    if _pool is None or _pool_n != n:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool, _pool_n = ThreadPoolExecutor(n, thread_name_prefix="pympar-chunk"), n
    return _pool


def over_chunks(n_items: int, fn, n_threads: int) -> None:
    """Call ``fn(i0, i1)`` on ``min(n_threads, n_items)`` disjoint ranges covering [0, n_items):
    side by side on threads with the BLAS at one thread when n_threads > 1 and the BLAS can be
    set, else once serially (fn(0, n_items)). ``fn`` must write disjoint outputs per range."""
    parts = min(int(n_threads), int(n_items))
    if parts <= 1 or os.environ.get("PYMPAR_CHUNK_THREADS", "") == "0" or not _openblas() \
            or not _lock.acquire(blocking=False):   # nested or concurrent use: serial
        fn(0, n_items)
        return
    try:
        before = blas_threads()
        set_blas_threads(1)
        try:
            bounds = [n_items * i // parts for i in range(parts + 1)]
            futs = [_executor(parts).submit(fn, bounds[i], bounds[i + 1]) for i in range(1, parts)]
            fn(bounds[0], bounds[1])          # the caller takes the first range
            for f in futs:
                f.result()
        finally:
            set_blas_threads(before)
    finally:
        _lock.release()
