"""One Python face per kernel, dispatching to C++ (NumPy arrays), CUDA (CuPy arrays)
or the pure-xp reference in :mod:`pympar.kernels.reference`.

- NumPy arrays go to :mod:`pympar.kernels.native` (``pympar._C``) when it is built; it hands
  dtypes and layouts it does not cover to the reference itself.
- CuPy arrays go to :mod:`pympar.kernels.cuda` (``pympar._cuda``) when it is built, else to
  the reference (which runs on CuPy unchanged).
- ``use_reference(True)`` (``PYMPAR_KERNELS=reference`` where an application reads the
  environment: pympar.config) forces the reference everywhere; ``backend(array)`` says which
  implementation an array would get, ``describe()`` which kernels run and, when the reference runs
  because ``pympar._C`` is missing, why; ``require_native(who)`` refuses that silent case.
- ``set_num_threads(n)`` sets the C++ kernels' threads in this process: exactly n threads run
  each kernel call. Until it is called, ``library_default_threads()`` (the BLAS's count, which
  follows OMP_NUM_THREADS, within the process's CPU affinity). It also gives the BLAS the same n threads and, where OpenBLAS
  allows it, runs the BLAS's parallel work on those same threads (``blas.share_kernel_threads``;
  ``PYMPAR_BLAS_THREADS=own`` opts out). Until it is called the BLAS is left as NumPy set it up.
  The trainer calls it at start-up with --threads, $PYMPAR_NUM_THREADS/$OMP_NUM_THREADS, or the
  node's cores divided by its ranks (pympar.parallel.cores.share_cores).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import reference
from ..backend import is_cupy

_native_missing = ""    # why pympar._C did not import (the ImportError's text)
try:
    from .. import _C as _native  # C++ kernels (pybind11)
    from . import native as _cpu
except ImportError as e:  # no native build: the reference kernels serve (slowly: describe() says so)
    _native = None
    _cpu = None
    _native_missing = str(e)

try:
    from . import cuda as _gpu  # imports pympar._cuda; fails cleanly without it
except ImportError:
    _gpu = None

_threads = 1

__all__ = [
    "softmax_causal_forward", "softmax_causal_backward", "attention_forward", "attention_backward",
    "attention_block_forward", "attention_block_backward",
    "layernorm_forward", "layernorm_backward", "bias_add", "column_sum", "scatter_add",
    "gelu_forward", "gelu_backward", "cross_entropy_forward", "cross_entropy_backward", "adamw_step",
    "topk", "capacity_positions", "permute", "unpermute_add", "cast", "reduce_inplace", "scale_inplace", "exact_add", "exact_raise", "exact_value",
    "set_num_threads", "set_process_threads", "get_num_threads", "max_threads", "use_isa", "native_available", "cuda_available", "backend", "use_reference",
]


def native_available() -> bool:
    """True when the C++ kernels (pympar._C) are built and importable."""
    return _native is not None


class NativeMissingError(ValueError):
    """A speed would be measured (or a run trained) on the reference kernels without being asked."""


def describe() -> str:
    """Which kernels NumPy arrays get, for a start-up line: 'C++ avx512', or 'reference' and why."""
    if _force_reference:
        return "reference (PYMPAR_KERNELS=reference)"
    if _native is None:
        return f"reference (pympar._C did not import: {_native_missing})"
    return f"C++ {native_isa()}"


def require_native(who: str) -> None:
    """Raise NativeMissingError (one line: why and what to do) when pympar._C is missing and the
    reference was not asked for: ``who`` (the trainer, a benchmark) would run 10-100x slower than
    the package it believes it runs, and report that speed."""
    if _native is not None or _force_reference:
        return
    raise NativeMissingError(
        f"the C++ kernels (pympar._C) are missing from {Path(__file__).parent.parent} ({_native_missing}), "
        f"so {who} would run the reference kernels, 10-100x slower; install the package (pip install . in a checkout, pip install -e . to develop) "
        "and run it from that environment, or set PYMPAR_KERNELS=reference to run the slow reference kernels on purpose")


def cuda_available() -> bool:
    """True when the CUDA kernels (pympar._cuda) are built and importable (a GPU may still be absent)."""
    return _gpu is not None


def native_isa() -> str | None:
    """The instruction-set build of the C++ kernels in use ('avx512', 'avx2', 'generic'), or None."""
    return _native.isa() if _native is not None else None


def set_num_threads(n: int, *, blas: bool = True) -> None:
    """Threads used by each C++ kernel call in this process (default: library_default_threads(),
    set at import); ``blas``: the BLAS's parallel jobs run on the same n threads (see the module
    docstring)."""
    global _threads
    n = int(n)
    if n < 1:
        raise ValueError(f"set_num_threads: n={n} must be >= 1")
    if n > max_threads():
        raise ValueError(f"set_num_threads: n={n} is more than the C++ kernel pool's {max_threads()} threads")
    _threads = n
    if _native is not None:
        _native.set_num_threads(n)
        if blas:
            from .blas import share_kernel_threads
            share_kernel_threads(n)


def max_threads() -> int:
    """The most threads set_num_threads accepts (the C++ pool's limit; no limit without it)."""
    return int(_native.max_threads) if _native is not None else 1 << 30


def set_process_threads(n: int) -> None:
    """This process's threads: the C++ kernels and the BLAS (any BLAS threadpoolctl knows, when
    it is installed, beside the OpenBLAS sharing of ``set_num_threads``)."""
    set_num_threads(n)
    try:
        from threadpoolctl import threadpool_limits  # optional

        threadpool_limits(n)
    except Exception:
        pass


def set_spin_us(us: int) -> None:
    """Microseconds an idle C++ kernel thread spins before it sleeps (0: sleep at once, for a node
    running more threads than cores). A no-op without the native module."""
    if _native is not None:
        _native.set_spin_us(max(0, int(us)))


def use_isa(name: str) -> None:
    """Run the C++ kernels of one instruction-set build: 'generic', 'avx2', 'avx512' (ValueError
    when the CPU lacks it), or '' for the best this CPU supports (the default)."""
    if _native is not None:
        _native.use_isa(name)


def get_num_threads() -> int:
    return _threads


_force_reference = False         # use_reference (PYMPAR_KERNELS=reference at the edge, pympar.config)


def use_reference(flag: bool = True) -> None:
    """Route every kernel call to the reference (True) or to the best implementation (False)."""
    global _force_reference
    _force_reference = bool(flag)


def _forced_reference() -> bool:
    return _force_reference


def backend(a) -> str:
    """'cuda', 'cpp' or 'reference': the implementation a call on array `a` is routed to.

    (A native route may still hand an unsupported dtype to the reference.)"""
    if _forced_reference():
        return "reference"
    if is_cupy(a):
        return "cuda" if _gpu is not None else "reference"
    return "cpp" if _cpu is not None else "reference"


def _dispatch(name):
    ref = getattr(reference, name)
    cpu = getattr(_cpu, name) if _cpu is not None else ref
    gpu = getattr(_gpu, name, ref) if _gpu is not None else ref  # a kernel CUDA lacks: the reference
    ndarray = np.ndarray

    def kernel(*args, **kwargs):
        if _force_reference:
            return ref(*args, **kwargs)
        if type(args[0]) is ndarray:  # the common case first: one type check per call
            return cpu(*args, **kwargs)
        return (gpu if is_cupy(args[0]) else cpu)(*args, **kwargs)

    kernel.__name__ = name
    kernel.__qualname__ = name
    kernel.__doc__ = ref.__doc__
    return kernel


softmax_causal_forward = _dispatch("softmax_causal_forward")
softmax_causal_backward = _dispatch("softmax_causal_backward")
attention_forward = _dispatch("attention_forward")
attention_backward = _dispatch("attention_backward")
attention_block_forward = _dispatch("attention_block_forward")
attention_block_backward = _dispatch("attention_block_backward")
layernorm_forward = _dispatch("layernorm_forward")
layernorm_backward = _dispatch("layernorm_backward")
add_layernorm_forward = _dispatch("add_layernorm_forward")
bias_gelu_forward = _dispatch("bias_gelu_forward")
bias_add = _dispatch("bias_add")
column_sum = _dispatch("column_sum")
scatter_add = _dispatch("scatter_add")
gelu_forward = _dispatch("gelu_forward")
gelu_backward = _dispatch("gelu_backward")
cross_entropy_forward = _dispatch("cross_entropy_forward")
cross_entropy_backward = _dispatch("cross_entropy_backward")
adamw_step = _dispatch("adamw_step")
topk = _dispatch("topk")
capacity_positions = _dispatch("capacity_positions")
permute = _dispatch("permute")
unpermute_add = _dispatch("unpermute_add")
cast = _dispatch("cast")
reduce_inplace = _dispatch("reduce_inplace")
exact_add = _dispatch("exact_add")
exact_raise = _dispatch("exact_raise")
exact_value = _dispatch("exact_value")
scale_inplace = _dispatch("scale_inplace")

def library_default_threads() -> int:
    """The kernel threads of a program that imports pympar and sets no count: NumPy's convention --
    as many as NumPy's BLAS runs (OpenBLAS takes OMP_NUM_THREADS / OPENBLAS_NUM_THREADS when NumPy
    loads it, else one per CPU), never more than the CPUs this process may run on (its affinity)."""
    import os

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:                     # not Linux
        cpus = os.cpu_count() or 1
    from .blas import blas_threads

    return max(1, min(cpus, blas_threads() or cpus, max_threads()))


# a library user's default (set_num_threads wins; the trainer shares the node's cores among its ranks)
set_num_threads(library_default_threads(), blas=False)
