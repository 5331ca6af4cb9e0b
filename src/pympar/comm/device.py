"""CuPy operands: stream synchronisation, CUDA-aware MPI detection, host staging."""
from __future__ import annotations

import ctypes

from .. import backend
from .settings import SETTINGS

_cuda_aware = None


def cuda_aware_mpi() -> bool:
    """Whether the MPI library reads device memory: the cuda_aware_mpi setting decides when set
    (pympar.comm.settings; PYMPAR_CUDA_AWARE_MPI=0/1 at the edge), else the library's own
    MPIX_Query_cuda_support when it exports one, else False."""
    global _cuda_aware
    if SETTINGS.cuda_aware_mpi is not None:
        return bool(SETTINGS.cuda_aware_mpi)
    if _cuda_aware is None:
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


def needs_staging(*arrays, reduction=False) -> bool:
    """Whether device operands must go through host copies for MPI: always without a CUDA-aware
    MPI; with one, still for a reduction of a dtype MPI has no type for (float16, bfloat16), whose
    user-defined op is a host callback that would be handed device pointers."""
    dev = [a for a in arrays if a is not None and backend.is_cupy(a)]
    if not dev:
        return False
    if not cuda_aware_mpi():
        return True
    if reduction:
        from .dtypes import has_mpi_type
        return not all(has_mpi_type(a.dtype) for a in dev)
    return False


def to_host(a):
    return None if a is None else backend.to_numpy(a)


def copy_back(dev, host):
    """Write a host result into a device array (in place)."""
    dev.set(host) if hasattr(dev, "set") else dev.__setitem__(..., host)
    return dev
