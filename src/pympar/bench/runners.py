"""One benchmark case per collective: buffers, the call to time, the expected answer."""
from __future__ import annotations

import numpy as np

from ..comm.dtypes import reference_reduce
from ..comm.verbs import VERBS

# nccl-tests bus-bandwidth factors: each verb's (pympar.comm.verbs), and a sendrecv's (1: one link)
BUSBW = {**{name: v.bus_factor for name, v in VERBS.items()}, "sendrecv": lambda n: 1.0}
IN_PLACE = {name for name, v in VERBS.items() if v.in_place}


def fill(rank, count, dtype, xp=np):
    return xp.asarray(((np.arange(count) % 7) - 3 + rank).astype(dtype))


class Case:
    """Holds buffers of one (collective, size, dtype) and runs it with an algorithm."""

    def __init__(self, comm, coll, nbytes, dtype, op, xp=np):
        self.comm, self.coll, self.op, self.xp, self.dtype = comm, coll, op, xp, np.dtype(dtype)
        n, r = comm.size, comm.rank
        it = self.dtype.itemsize
        count = nbytes // it
        if coll in ("allgather", "alltoall", "alltoallv"):
            count = count // n * n       # whole per-rank blocks
        self.count, self.nbytes = count, count * it
        per = count // n if coll in ("allgather",) else count
        self.x = fill(r, per, self.dtype, xp)
        self.out = xp.empty(count if coll != "reduce_scatter" else len(np.array_split(np.arange(count), n)[r]), self.dtype)

    def run(self, algo, in_place, lib=None):
        c, coll, x = self.comm, self.coll, self.x
        n, r = c.size, c.rank
        if lib is not None:
            return lib(self)
        if coll == "allreduce":
            return c.allreduce(x, op=self.op, algo=algo) if in_place else c.allreduce(x, op=self.op, algo=algo, out=self.out)
        if coll == "reduce_scatter":
            return c.reduce_scatter(x, op=self.op, algo=algo, out=self.out)
        if coll == "allgather":
            return c.allgather(x, algo=algo, out=self.out)
        if coll == "broadcast":
            return c.broadcast(x, root=0, algo=algo)
        if coll == "alltoall":
            return c.alltoall(x, out=self.out, algo=algo)
        if coll == "alltoallv":
            k = self.count // n
            counts = np.full(n, k)
            return c.alltoallv(x, counts, recv_counts=counts, out=self.out)[0]
        if coll == "sendrecv":
            return c.sendrecv(x, (r + 1) % n, self.out, (r - 1) % n)
        raise ValueError(coll)

    def wrong(self, algo, in_place, lib=None):
        """Elements that differ from the NumPy reference after one fresh call."""
        n, r = self.comm.size, self.comm.rank
        self.x[...] = fill(r, self.x.size, self.dtype, self.xp)
        got = np.asarray(self.run(algo, in_place, lib) if lib is None else lib(self, check=True))
        got = got.get() if hasattr(got, "get") else got
        per = self.x.size
        if self.coll == "allreduce":
            want = reference_reduce([fill(k, per, self.dtype) for k in range(n)], self.op)
        elif self.coll == "reduce_scatter":
            want = reference_reduce([fill(k, per, self.dtype) for k in range(n)], self.op)
            want = np.array_split(want, n)[r]
        elif self.coll == "allgather":
            want = np.concatenate([fill(k, per, self.dtype) for k in range(n)])
        elif self.coll == "broadcast":
            want = fill(0, per, self.dtype)
        elif self.coll in ("alltoall", "alltoallv"):
            k = per // n
            want = np.concatenate([fill(j, per, self.dtype)[r * k:(r + 1) * k] for j in range(n)])
        else:
            want = fill((r - 1) % n, per, self.dtype)
        tol = 0.05 if self.dtype.itemsize == 2 else 1e-5
        return int(np.sum(~np.isclose(got.astype(np.float64), want.astype(np.float64), atol=tol, rtol=tol)))
