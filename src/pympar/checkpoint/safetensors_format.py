"""The safetensors file format, written and read with NumPy alone (no runtime dependency).

Layout of a file:  u64 little-endian N | N bytes of JSON header (space-padded to 8 bytes) | data.
The header maps each tensor name to {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}
(offsets relative to the start of the data, tensors back to back in C order, little endian) and
may hold "__metadata__": {str: str}. The tests check these files against the `safetensors` package.

Reading maps the file and copies out only the requested slice of a tensor, so a rank that
needs one shard of a large file touches only those pages.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np

from .. import backend
from ..backend import to_numpy
from .errors import CheckpointCorrupt

# safetensors dtype code <-> numpy dtype
_CODES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

_MAX_HEADER = 100_000_000  # the reference implementation's limit


def dtype_code(dt) -> str:
    """'F32', 'BF16', ... for a numpy dtype; ValueError for dtypes safetensors cannot hold."""
    dt = np.dtype(dt)
    if backend.is_bfloat16(dt):
        return "BF16"
    for code, known in _CODES.items():
        if dt == known:
            return code
    raise ValueError(f"dtype {dt} cannot be stored in safetensors: expected one of {sorted(_CODES)}")


def code_dtype(code: str, path="") -> np.dtype:
    if code == "BF16" and backend.bfloat16 is not None:     # ml_dtypes, imported when a file holds bf16
        return backend.bfloat16
    if code not in _CODES:
        raise CheckpointCorrupt(path, f"unknown safetensors dtype {code!r}")
    return _CODES[code]


def code_itemsize(code: str, path="") -> int:
    """Bytes per element of a safetensors dtype code (without importing ml_dtypes for BF16)."""
    if code == "BF16":
        return 2
    if not isinstance(code, str) or code not in _CODES:
        raise CheckpointCorrupt(path, f"unknown safetensors dtype {code!r}")
    return _CODES[code].itemsize


def _header_bytes(tensors: dict, metadata: dict | None):
    header, offset = {}, 0
    for name, a in tensors.items():
        nbytes = a.size * a.dtype.itemsize
        header[name] = {"dtype": dtype_code(a.dtype), "shape": [int(s) for s in a.shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(f"safetensors metadata must map str -> str; bad keys {bad}")
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write(path, tensors: dict, metadata: dict | None = None, fsync: bool = True) -> str:
    """Write {name: ndarray} (C order, little endian) to ``path``; return the file's sha256 hex."""
    tensors = {k: np.asarray(to_numpy(v), order="C") for k, v in tensors.items()}  # GPU arrays: host copies  # (ascontiguousarray makes 0-d 1-d)
    for k, a in tensors.items():
        if a.dtype.byteorder == ">":
            tensors[k] = a.astype(a.dtype.newbyteorder("<"))
    h = hashlib.sha256()
    with open(path, "wb") as f:
        head = _header_bytes(tensors, metadata)
        f.write(head)
        h.update(head)
        for a in tensors.values():
            buf = memoryview(a.reshape(-1).view(np.uint8))
            f.write(buf)
            h.update(buf)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def read_header(path):
    """(header dict without __metadata__, metadata dict, data start offset); checks the layout."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise CheckpointCorrupt(path, f"truncated: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", first)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointCorrupt(path, f"truncated or not safetensors: header length {n} but file has {size} bytes")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointCorrupt(path, "missing shard file") from None
    except OSError as e:                                    # unreadable (permissions, I/O)
        raise CheckpointCorrupt(path, f"unreadable ({e.strerror or type(e).__name__})") from None
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:   # (RecursionError: nested 100,000 deep)
        raise CheckpointCorrupt(path, f"unreadable safetensors header ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise CheckpointCorrupt(path, "safetensors header: expected an object of tensors")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CheckpointCorrupt(path, "safetensors header: __metadata__ must be an object")
    start = 8 + n
    for name, info in header.items():
        _check_entry(path, name, info, size - start)
    return header, meta, start


def _check_entry(path, name, info, data_bytes):
    """One header entry, type- and range-checked against the file's real size before anything is
    allocated from it: dtype a known code, shape non-negative integers, data_offsets two integers
    0 <= begin <= end <= the data's bytes, holding exactly shape x itemsize bytes."""
    def ok_int(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(info, dict):
        raise CheckpointCorrupt(path, f"tensor {name!r}: header entry is not an object")
    shape, offs, code = info.get("shape"), info.get("data_offsets"), info.get("dtype")
    if not isinstance(code, str):
        raise CheckpointCorrupt(path, f"tensor {name!r}: dtype is not a string")
    dt = code_dtype(code, path)
    if not isinstance(shape, list) or not all(ok_int(s) for s in shape):
        raise CheckpointCorrupt(path, f"tensor {name!r}: shape is not a list of integers >= 0")
    if not isinstance(offs, list) or len(offs) != 2 or not all(ok_int(v) for v in offs) or offs[0] > offs[1]:
        raise CheckpointCorrupt(path, f"tensor {name!r}: data_offsets are not two integers 0 <= begin <= end")
    b, e = offs
    want = dt.itemsize
    for s in shape:                           # in Python integers: a shape of [2^64] cannot overflow
        want *= s
    if e - b != want:
        raise CheckpointCorrupt(path, f"tensor {name!r}: data_offsets {b}..{e} hold {e - b} bytes, shape {shape} needs {want}")
    if e > data_bytes:
        raise CheckpointCorrupt(path, f"truncated: tensor {name!r} ends at byte {e} of the data but the file holds {data_bytes}")


def read_slice(path, header, start, name, index=None):
    """The part ``index`` (tuple of slices, local coordinates) of tensor ``name``, as a fresh array."""
    info = header[name]
    dt = code_dtype(info["dtype"], path)
    shape = tuple(info["shape"])
    b, e = info["data_offsets"]
    if e == b:
        out = np.zeros(shape, dt)
        return out if index is None else out[index].copy()
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=start + b, shape=(e - b,))
    try:
        arr = mm.view(dt).reshape(shape)
        return np.array(arr if index is None else arr[index], copy=True)
    finally:
        del mm


def read_all(path):
    """({name: ndarray}, metadata) of a whole safetensors file."""
    header, meta, start = read_header(path)
    return {k: read_slice(path, header, start, k) for k in header}, meta


def read_mapped(path):
    """({name: read-only array mapped from the file}, metadata): nothing is copied; a page is read when
    it is used (an import streams a file through, however large its tensors claim to be)."""
    header, meta, start = read_header(path)
    out = {}
    for k, info in header.items():
        dt, shape = code_dtype(info["dtype"], path), tuple(info["shape"])
        b, e = info["data_offsets"]
        out[k] = (np.zeros(shape, dt) if e == b else
                  np.memmap(path, dtype=dt, mode="r", offset=start + b, shape=shape))
    return out, meta


def sha256_file(path, chunk=1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
