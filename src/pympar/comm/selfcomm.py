"""SelfComm: the communicator of one process, with no MPI underneath.

Single-process code calls the same verbs as a parallel run and gets the size-1 answers
(copies); send/recv to rank 0 go through a mailbox matched by tag, in order.
"""
from __future__ import annotations

import math
from collections import defaultdict, deque

import numpy as np

from .base import Communicator, check_op, check_out, contiguous, new_like
from .errors import CommTimeoutError
from .progress import DoneRequest, Request


class _MailRequest(Request):
    def __init__(self, comm, buf, tag):
        super().__init__([], [], None, None, buf)
        self._comm, self._buf, self._tag = comm, buf, tag

    def test(self):
        if not self._done:
            box = self._comm._mail[self._tag]
            if not box:
                return False
            self._buf[...] = box.popleft()
            self._done = True
        return True

    def wait(self):
        if not self.test():
            raise CommTimeoutError("recv", self._comm.name, self._comm.p2p_seq, [0], 0.0,
                                   "nothing was sent to this rank with that tag: a size-1 receive would wait forever")
        return self._buf


class SelfComm(Communicator):
    """Size-1 communicator: rank 0 of 1."""

    def __init__(self, name="self"):
        self.rank, self.size, self.name = 0, 1, name
        self.timeout = math.inf
        self.seq = self.p2p_seq = 0
        self._mail = defaultdict(deque)

    def _check_rank(self, r, what):
        if r != 0:
            raise ValueError(f"{what}={r} is not a rank of a size-1 communicator (only 0)")

    def allreduce(self, x, op="sum", algo="auto", out=None, inplace=True, reproducible=False):
        if reproducible:
            return self._reproducible("allreduce", x, op, out, inplace)
        check_op(op)
        x = contiguous(x, "allreduce operand")
        self.seq += 1
        if out is not None:
            check_out(out, x.shape, x.dtype, "allreduce")[...] = x
            return out
        return x if inplace else x.copy()

    def reduce_scatter(self, x, op="sum", algo="auto", out=None, reproducible=False):
        if reproducible:
            return self._reproducible("reduce_scatter", x, op, out)
        check_op(op)
        x = contiguous(x, "reduce_scatter operand")
        self.seq += 1
        out = check_out(out, x.shape, x.dtype, "reduce_scatter") if out is not None else new_like(x, x.shape)
        out[...] = x
        return out

    def allgather(self, x, algo="auto", out=None):
        x = contiguous(x, "allgather operand")
        x = x.reshape(1) if x.ndim == 0 else x
        self.seq += 1
        out = check_out(out, x.shape, x.dtype, "allgather") if out is not None else new_like(x, x.shape)
        out[...] = x
        return out

    def broadcast(self, x, root=0, algo="auto"):
        self._check_rank(root, "root")
        self.seq += 1
        return x

    def alltoall(self, x, out=None, algo="auto"):
        return self.allgather(x, out=out)

    def alltoallv(self, x, send_counts, recv_counts=None, out=None):
        sc = np.asarray(send_counts, dtype=np.int64).reshape(-1)
        rows = x.shape[0] if x.ndim else 0
        if sc.size != 1 or sc[0] != rows:
            raise ValueError(f"alltoallv: send_counts {sc.tolist()} must be [{rows}] on a size-1 communicator")
        return self.allgather(x, out=out), sc.copy()

    def barrier(self):
        self.seq += 1

    def isend(self, x, dest, tag=0):
        self._check_rank(dest, "dest")
        self.p2p_seq += 1
        self._mail[tag].append(np.array(x, copy=True))
        return DoneRequest(x)

    def irecv(self, buf, source, tag=0):
        self._check_rank(source, "source")
        self.p2p_seq += 1
        return _MailRequest(self, buf, tag)

    def sendrecv(self, x, dest, buf, source, sendtag=0, recvtag=None):
        self.isend(x, dest, sendtag)
        return self.irecv(buf, source, sendtag if recvtag is None else recvtag).wait()

    def split(self, color, key=None, name=None):
        return None if color is None else SelfComm(name or f"{self.name}/{color}")

    def free(self):
        pass
