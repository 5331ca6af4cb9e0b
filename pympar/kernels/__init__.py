"""One Python face per kernel, dispatching to C++ (NumPy arrays), CUDA (CuPy arrays)
or the pure-xp reference in :mod:`pympar.kernels.reference`.

Set ``PYMPAR_KERNELS=reference`` to force the reference everywhere (tests use it to
compare); ``backend()`` says which implementation an array would get.
"""
from __future__ import annotations

import os

from . import reference

try:
    from .. import _C as _native  # C++ kernels (pybind11)
except Exception:  # no native build: the reference kernels serve
    _native = None

_threads = 1


def native_available() -> bool:
    return _native is not None


def set_num_threads(n: int) -> None:
    """Threads used by each C++ kernel call in this process (default 1)."""
    global _threads
    _threads = max(1, int(n))
    if _native is not None and hasattr(_native, "set_num_threads"):
        _native.set_num_threads(_threads)


def get_num_threads() -> int:
    return _threads


def _forced_reference() -> bool:
    return os.environ.get("PYMPAR_KERNELS", "") == "reference"


# The native dispatch (filled in by the C++/CUDA wrappers below the reference):
# each public kernel name maps to reference.<name> unless a native version claims the call.
softmax_causal_forward = reference.softmax_causal_forward
softmax_causal_backward = reference.softmax_causal_backward
layernorm_forward = reference.layernorm_forward
layernorm_backward = reference.layernorm_backward
gelu_forward = reference.gelu_forward
gelu_backward = reference.gelu_backward
cross_entropy_forward = reference.cross_entropy_forward
cross_entropy_backward = reference.cross_entropy_backward
adamw_step = reference.adamw_step
topk = reference.topk
capacity_positions = reference.capacity_positions
permute = reference.permute
unpermute_add = reference.unpermute_add
cast = reference.cast
reduce_inplace = reference.reduce_inplace
scale_inplace = reference.scale_inplace

set_num_threads(int(os.environ.get("PYMPAR_NUM_THREADS", "1")))
