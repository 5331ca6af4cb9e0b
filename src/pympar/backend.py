"""Array backend: numpy on the CPU, cupy on a GPU, one face for both.

Code takes ``xp = xp_of(array)`` and never branches on the device otherwise.
"""
from __future__ import annotations


import numpy as np

_cupy = None
_bfloat16 = None        # NumPy's bfloat16 dtype (ml_dtypes), loaded on first use; False: not importable


def _load_bfloat16():
    """The bfloat16 dtype, importing ml_dtypes on first use: a run in float32 never pays its import
    (0.5-1 s of CPU for ml_dtypes 0.7.0 here, per rank)."""
    global _bfloat16
    if _bfloat16 is None:
        try:
            import ml_dtypes

            _bfloat16 = np.dtype(ml_dtypes.bfloat16)
        except Exception:  # pragma: no cover - ml_dtypes is a dependency
            _bfloat16 = False
    return _bfloat16 or None


def __getattr__(name):
    """``backend.bfloat16``: the dtype (or None without ml_dtypes), imported when first asked for."""
    if name == "bfloat16":
        return _load_bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cupy_or_none():
    """The cupy module if it imports and a GPU is visible, else None."""
    global _cupy
    if _cupy is None:
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()
            _cupy = cupy
        except Exception:
            _cupy = False
    return _cupy or None


def gpu_available() -> bool:
    return cupy_or_none() is not None


def xp_of(*arrays):
    """numpy or cupy: the array module of the arrays (numpy for scalars/None)."""
    for a in arrays:
        mod = type(a).__module__
        if mod.startswith("cupy"):
            return cupy_or_none()
    return np


def is_cupy(a) -> bool:
    return type(a).__module__.startswith("cupy")


def get_xp(device: str = "cpu"):
    """The array module for a device name: 'cpu' -> numpy, 'cuda' -> cupy."""
    if device == "cpu":
        return np
    if device in ("cuda", "gpu"):
        cp = cupy_or_none()
        if cp is None:
            raise RuntimeError("device='cuda' needs CuPy and a visible GPU: pip install 'pympar[cuda12]' on a GPU machine, or use device='cpu'")
        return cp
    raise ValueError(f"unknown device {device!r}: expected 'cpu' or 'cuda'")


def to_numpy(a):
    """A host copy (or the array itself when it is already on the host)."""
    if is_cupy(a):
        return a.get()
    return np.asarray(a)


def scatter_add(dst, idx, src):
    """dst[idx] += src with repeated indices accumulated (np.add.at; cupyx.scatter_add on CuPy)."""
    if is_cupy(dst):
        import cupyx

        cupyx.scatter_add(dst, idx, src)
    else:
        np.add.at(dst, idx, src)
    return dst


_lowp_gemm = {}


def lowp_gemm(a) -> bool:
    """Whether ``a @ b`` in a's float16/bfloat16 dtype runs natively with float32 accumulation
    (CuPy -> cuBLAS tensor cores). NumPy: False (callers multiply in float32 and round). A
    CuPy without bfloat16 matrix products (probed once per dtype) also answers False."""
    if not is_cupy(a):
        return False
    key = np.dtype(a.dtype).name
    if key not in _lowp_gemm:
        cp = cupy_or_none()
        try:
            t = cp.ones((4, 4), dtype=a.dtype)
            _lowp_gemm[key] = bool(float((t @ t).astype(cp.float32)[0, 0]) == 4.0)
        except Exception:
            _lowp_gemm[key] = False
    return _lowp_gemm[key]


def to_device(a, device: str):
    xp = get_xp(device)
    if xp is np:
        return to_numpy(a)
    return xp.asarray(a)


_DTYPES = {
    "float32": np.dtype(np.float32), "fp32": np.dtype(np.float32),
    "float64": np.dtype(np.float64), "fp64": np.dtype(np.float64),
    "float16": np.dtype(np.float16), "fp16": np.dtype(np.float16),
    "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
}
_BF16_NAMES = ("bfloat16", "bf16")


def dtype(name_or_dtype):
    """Resolve 'float32' | 'float16' | 'bfloat16' | 'float64' | np.dtype to a NumPy dtype."""
    if isinstance(name_or_dtype, str):
        if name_or_dtype in _BF16_NAMES and _load_bfloat16() is not None:
            return _load_bfloat16()
        try:
            return _DTYPES[name_or_dtype]
        except KeyError:
            known = sorted(_DTYPES) + (list(_BF16_NAMES) if _load_bfloat16() is not None else [])
            raise ValueError(f"unknown dtype {name_or_dtype!r}: expected one of {sorted(known)}") from None
    return np.dtype(name_or_dtype)


def dtype_name(dt) -> str:
    return np.dtype(dt).name                     # ml_dtypes' bfloat16 is named "bfloat16"


def is_bfloat16(dt) -> bool:
    """Whether dt is bfloat16 (by name: asking does not import ml_dtypes)."""
    return np.dtype(dt).name == "bfloat16"


def is_low_precision(dt) -> bool:
    dt = np.dtype(dt)
    return dt == np.float16 or dt.name == "bfloat16"


def resident_zeros(shape, dtype, xp=np):
    """Zeros whose pages are written now: state that lives for the whole run (optimizer moments,
    reduced-gradient rows) is then resident from the start, below the activations that come and go,
    instead of being faulted in after them where freed activation memory cannot serve it."""
    a = xp.empty(shape, dtype=dtype)
    a.fill(0)
    return a


def held_bytes(*objs) -> int:
    """Bytes of the arrays reachable in nested dicts/lists/tuples, each underlying buffer once
    (views share their base: q, k and v of one qkv tensor count as the qkv tensor)."""
    seen, total = set(), 0
    stack = list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, np.ndarray) or is_cupy(o):
            base = o
            while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes"):
                base = base.base
            if id(base) not in seen:
                seen.add(id(base))
                total += int(base.nbytes)
    return total
