"""Datatypes and reduction ops as MPI sees them.

float32/float64/int32/int64 travel as their MPI types; float16 and bfloat16 travel as raw
2-byte elements (a contiguous MPI type of 2 bytes) and are reduced by
``pympar.kernels.reduce_inplace``, inside a user-defined MPI op when the library reduces.
"""
from __future__ import annotations

import numpy as np

from .. import backend, kernels
from .lazympi import MPI

OPS = ("sum", "avg", "max", "min", "prod")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")

_NATIVE: dict = {}          # numpy dtype -> MPI type; filled on first use (importing MPI starts it)
_NATIVE_OPS: dict = {}
_raw2 = None
_user_ops: dict = {}


def _native() -> dict:
    if not _NATIVE:
        _NATIVE.update({np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
                        np.dtype(np.int32): MPI.INT32_T, np.dtype(np.int64): MPI.INT64_T,
                        np.dtype(np.uint8): MPI.BYTE})
        _NATIVE_OPS.update({"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD})
    return _NATIVE


def check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}: expected one of {', '.join(OPS)}")
    return op


_ACCEPTED = set()   # dtypes check_dtype passed (numpy's dtype-name lookup costs ~1 us a call)


def check_dtype(dt) -> np.dtype:
    if dt in _ACCEPTED:
        return dt
    dt = np.dtype(dt)
    if backend.dtype_name(dt) not in DTYPES and dt != np.uint8:
        raise TypeError(f"dtype {dt} is not supported by pympar.comm: expected one of {', '.join(DTYPES)}")
    _ACCEPTED.add(dt)
    return dt


def raw2():
    """The MPI type of one 2-byte element (float16, bfloat16 on the wire)."""
    global _raw2
    if _raw2 is None:
        _raw2 = MPI.BYTE.Create_contiguous(2).Commit()
    return _raw2


def mpi_type(dt):
    dt = np.dtype(dt)
    t = (_NATIVE or _native()).get(dt)
    if t is not None:
        return t
    if dt.itemsize == 2:
        return raw2()
    raise TypeError(f"no MPI type for dtype {dt}")


def wire(a):
    """The buffer spec mpi4py wants for a contiguous array: [buffer, MPI type].

    No count: mpi4py derives it from the buffer, per peer for alltoall/allgather receives.
    """
    dt = a.dtype
    native = _NATIVE or _native()
    if dt in native:
        return [a, native[dt]]
    return [a.view(np.uint16), raw2()]   # memoryview refuses bfloat16: pass raw 2-byte words


def raw_bytes(a):
    """[buffer, MPI.BYTE] for a contiguous array of any dtype: what the p2p algorithms move."""
    return [a.reshape(-1).view(np.uint8), MPI.BYTE]


def has_mpi_type(dt) -> bool:
    """Whether MPI reduces dt with its own (predefined) ops."""
    return np.dtype(dt) in (_NATIVE or _native())


def mpi_op(op: str, dt):
    """The MPI op reducing ``dt`` elements with ``op`` (avg reduces as sum; the caller divides)."""
    dt = np.dtype(dt)
    if dt in (_NATIVE or _native()):
        return _NATIVE_OPS[op]
    key = (backend.dtype_name(dt), op)
    if key not in _user_ops:
        red = "sum" if op == "avg" else op

        def fn(inbuf, inoutbuf, datatype, _dt=dt, _red=red):
            src = np.frombuffer(inbuf, dtype=_dt)
            dst = np.frombuffer(inoutbuf, dtype=_dt)
            kernels.reduce_inplace(dst, src, _red)

        _user_ops[key] = MPI.Op.Create(fn, commute=True)
    return _user_ops[key]


def reduce_op(op: str) -> str:
    """The elementwise op the algorithms apply (avg is a sum followed by finish_avg)."""
    return "sum" if op == "avg" else op


def finish_avg(a, n: int):
    """Turn a sum over n ranks into the mean: floats scale by 1/n, integers floor-divide."""
    if n == 1 or a.size == 0:
        return a
    if a.dtype.kind in "iu":
        xp = backend.xp_of(a)
        xp.floor_divide(a, n, out=a)
    else:
        kernels.scale_inplace(a, 1.0 / n)
    return a


def reference_reduce(arrays, op: str):
    """NumPy oracle: op over a list of arrays, accumulated in float64 / int64."""
    acc = np.stack([np.asarray(a).astype(np.float64 if np.asarray(a).dtype.kind == "f" or backend.is_low_precision(np.asarray(a).dtype) else np.int64) for a in arrays])
    if op in ("sum", "avg"):
        r = acc.sum(axis=0)
        if op == "avg":
            r = r // len(arrays) if acc.dtype.kind == "i" else r / len(arrays)
        return r
    return {"max": acc.max, "min": acc.min, "prod": acc.prod}[op](axis=0)
