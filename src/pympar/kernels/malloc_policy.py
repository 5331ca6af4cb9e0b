"""Keep freed host memory in the process (glibc malloc), so a training step's activations do
not page-fault their way back in every step.

Why: a step allocates tens of MB of fresh activations (forward) and frees them (backward).
glibc hands blocks above its mmap threshold back to the kernel on free, and trims the top of
the heap above its trim threshold, so the next step maps the same memory again and pays one
page fault (a 4 KiB zero-fill) per page *on the thread that first writes it* - often inside a
GEMM or a single-threaded NumPy pass. Measured on bench/train_step.py --preset small: 22,500
minor faults per step before, 0 after, and the step 25-35% faster (see docs/engine.md, Speed).

``retain_freed_memory()`` raises both thresholds (``mallopt``), so freed blocks stay in the
heap and are reused: the process keeps its peak working set, like a caching allocator.
It is a no-op off glibc. The applications call it at start-up (``pympar.config.apply_environment``)
unless ``PYMPAR_MALLOC=system`` is set (the opt-out).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

_done = None  # None: not tried; True/False: the outcome of the one attempt


def retain_freed_memory(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Blocks below ``mmap_threshold`` bytes come from the heap; up to ``trim_threshold``
    bytes of free heap top stay mapped. Returns True when glibc accepted both (once per process)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: nothing to tune
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, int(mmap_threshold))) and \
        bool(mallopt(M_TRIM_THRESHOLD, int(trim_threshold)))
    return _done


def retained() -> bool:
    """True when retain_freed_memory() took effect in this process."""
    return bool(_done)
