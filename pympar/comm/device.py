"""CuPy operands: stream synchronisation, CUDA-aware MPI detection, host staging."""
from __future__ import annotations

import ctypes
import os

from .. import backend

_cuda_aware = None


def cuda_aware_mpi() -> bool:
    """Whether the MPI library reads device memory: PYMPAR_CUDA_AWARE_MPI=0/1 decides when
    set, else the library's own MPIX_Query_cuda_support when it exports one, else False."""
    global _cuda_aware
    if _cuda_aware is None:
        v = os.environ.get("PYMPAR_CUDA_AWARE_MPI")
        if v is not None:
            _cuda_aware = v.strip().lower() in ("1", "true", "yes")
        else:
            _cuda_aware = False
            try:
                fn = ctypes.CDLL(None).MPIX_Query_cuda_support
                fn.restype = ctypes.c_int
                _cuda_aware = bool(fn())
            except (AttributeError, OSError):
                pass
    return _cuda_aware


def sync_stream(a) -> None:
    """Let the GPU finish writing ``a`` before MPI reads its memory."""
    if backend.is_cupy(a):
        backend.cupy_or_none().cuda.get_current_stream().synchronize()


def needs_staging(*arrays) -> bool:
    return any(backend.is_cupy(a) for a in arrays if a is not None) and not cuda_aware_mpi()


def to_host(a):
    return None if a is None else backend.to_numpy(a)


def copy_back(dev, host):
    """Write a host result into a device array (in place)."""
    dev.set(host) if hasattr(dev, "set") else dev.__setitem__(..., host)
    return dev
