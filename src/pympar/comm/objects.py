"""Python objects through a pympar Communicator: gather_object, the timed twin of mpi4py's
lower-case ``comm.gather``. The payload travels pickled in uint8 arrays over the
communicator's own allgather and send/recv, so ``comm.timeout`` (and the watchdog) apply:
a rank that never arrives raises CommTimeoutError instead of hanging the job."""
from __future__ import annotations

import pickle

import numpy as np

GATHER_TAG = 32001   # a tag of its own: no pipeline message (tags < 32767) is in flight then


def gather_object(comm, obj, root: int = 0) -> list | None:
    """Collective: [obj of rank 0, ..., obj of rank size-1] on ``root``, None elsewhere.
    comm: a pympar Communicator, or None for one process."""
    if comm is None or comm.size == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    lens = np.asarray(comm.allgather(np.array([data.size], np.int64)))   # (size,)
    if comm.rank != root:
        comm.send(data, root, tag=GATHER_TAG)
        return None
    out = []
    for r in range(comm.size):
        if r == root:
            out.append(obj)
            continue
        buf = np.empty(int(lens[r]), np.uint8)
        comm.recv(buf, r, tag=GATHER_TAG)
        out.append(pickle.loads(buf.tobytes()))
    return out
