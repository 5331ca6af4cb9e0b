"""The few collectives a checkpoint needs, on JSON-able objects, over any communicator.

Accepts a pympar Communicator, a raw mpi4py communicator, or None (one process). Objects
travel as UTF-8 JSON in uint8 arrays (no pickle anywhere), so every rank sees the same
values and can raise the same error instead of leaving the others waiting.
"""
from __future__ import annotations

import json

import numpy as np


def rank_size(comm):
    if comm is None:
        return 0, 1
    return int(comm.rank), int(comm.size)


def _allgather_array(comm, x):  # x (n,) -> (size, n)
    size = rank_size(comm)[1]
    if hasattr(comm, "Allgather"):  # mpi4py buffer interface
        out = np.empty((size,) + x.shape, x.dtype)
        comm.Allgather(x, out)
        return out
    return np.asarray(comm.allgather(x)).reshape(size, *x.shape)


def allgather_json(comm, obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    _, size = rank_size(comm)
    if size == 1:
        return [json.loads(json.dumps(obj))]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lens = _allgather_array(comm, np.array([data.size], np.int64)).reshape(size)
    buf = np.zeros(int(lens.max()), np.uint8)
    buf[: data.size] = data
    allb = _allgather_array(comm, buf)
    return [json.loads(allb[r, : lens[r]].tobytes().decode()) for r in range(size)]


def agree(comm, error: Exception | None, what: str):
    """Collective: raise on every rank if any rank failed, else return.

    The failing rank re-raises its own exception; the others raise the same class of
    checkpoint error with the same path and words (``.rank``: the first failing rank), so every
    rank can say the same line and none walks on into a collective the others skip.
    """
    from . import errors

    mine = None if error is None else {"type": type(error).__name__, "msg": str(error),
                                       "path": getattr(error, "path", None), "problem": getattr(error, "problem", None)}
    bad = [(r, e) for r, e in enumerate(allgather_json(comm, mine)) if e is not None]
    if not bad:
        return
    if error is not None:
        raise error
    r, e = bad[0]
    cls = getattr(errors, e["type"], errors.CheckpointError)
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
        cls = errors.CheckpointError
    if e.get("path") is not None and e.get("problem") is not None:   # the same words on every rank
        err = cls(e["path"], e["problem"])
    else:
        err = cls(f"rank {r}", f"{what} failed there: {e['msg']}")
    err.rank = r
    raise err
