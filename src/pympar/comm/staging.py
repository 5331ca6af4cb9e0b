"""HostStaging: device (CuPy) operands over an MPI library that cannot take them, through host copies.

``HostStaging(comm)`` wraps a communicator (an MPIComm). A call whose operands need it
(``device.needs_staging``: device arrays when the MPI library is not CUDA-aware; with a
CUDA-aware one, a reduction of a dtype MPI has no type for, whose user-defined op runs on the
host) copies the operand to the host, runs the wrapped communicator's call on that copy and
lands the result on the device: in ``out`` when given, in the operand itself where the verb
works in place (allreduce with inplace=True, broadcast), else in a new device array. A
nonblocking call returns a request whose ``wait()`` (or the ``test()`` that finds it done) makes
the copy back once. Every other call -- host operands, a CUDA-aware library's device operands,
barrier, topology, the tuner -- is the wrapped communicator's own, and ``split`` wraps the
sub-communicator. ``DeviceComm.mpi_only`` (a GPU job without NCCL) puts its MPIComm in one;
MPIComm itself refuses device operands it cannot pass, naming this wrapper.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from .base import Communicator
from .device import copy_back, needs_staging, to_host


class HostStaging(Communicator):
    def __init__(self, comm):
        if isinstance(comm, HostStaging):
            raise TypeError("HostStaging wraps a communicator, not another HostStaging")
        self.comm = comm
        self.rank, self.size, self.name, self.timeout = comm.rank, comm.size, comm.name, comm.timeout

    def __getattr__(self, name):        # everything not staged: the wrapped communicator's
        if name.startswith("__") or name == "comm":
            raise AttributeError(name)
        return getattr(self.comm, name)

    def split(self, color, key=None, name=None):
        sub = self.comm.split(color, key, name=name)
        return None if sub is None else HostStaging(sub)

    def barrier(self):
        return self.comm.barrier()

    def ibarrier(self):
        return self.comm.ibarrier()

    # --- blocking verbs ----------------------------------------------------------------------
    def allreduce(self, x, op="sum", algo="auto", out=None, inplace=True, reproducible=False):
        if reproducible:
            return self._reproducible("allreduce", x, op, out, inplace)
        if not needs_staging(x, out, reduction=True):
            return self.comm.allreduce(x, op, algo, out=out, inplace=inplace)
        return _land(_into(x, out, inplace), x, self.comm.allreduce(to_host(x), op, algo))

    def reduce_scatter(self, x, op="sum", algo="auto", out=None, reproducible=False):
        if reproducible:
            return self._reproducible("reduce_scatter", x, op, out)
        if not needs_staging(x, out, reduction=True):
            return self.comm.reduce_scatter(x, op, algo, out=out)
        return _land(out, x, self.comm.reduce_scatter(to_host(x), op, algo))

    def allgather(self, x, algo="auto", out=None):
        if not needs_staging(x, out):
            return self.comm.allgather(x, algo, out=out)
        return _land(out, x, self.comm.allgather(to_host(x), algo))

    def broadcast(self, x, root=0, algo="auto"):
        if not needs_staging(x):
            return self.comm.broadcast(x, root, algo)
        return copy_back(x, self.comm.broadcast(to_host(x), root, algo))

    def alltoall(self, x, out=None, algo="auto"):
        if not needs_staging(x, out):
            return self.comm.alltoall(x, out=out, algo=algo)
        return _land(out, x, self.comm.alltoall(to_host(x), algo=algo))

    def alltoallv(self, x, send_counts, recv_counts=None, out=None):
        if not needs_staging(x, out):
            return self.comm.alltoallv(x, send_counts, recv_counts, out=out)
        res, rc = self.comm.alltoallv(to_host(x), send_counts, recv_counts)
        return _land(out, x, res), rc

    # --- nonblocking verbs: the copy back when the request completes --------------------------
    def iallreduce(self, x, op="sum", algo="auto", out=None, inplace=True):
        if not needs_staging(x, out, reduction=True):
            return self.comm.iallreduce(x, op, algo, out=out, inplace=inplace)
        dst = _into(x, out, inplace)
        return _Then(self.comm.iallreduce(to_host(x), op, algo), lambda h: _land(dst, x, h))

    def ireduce_scatter(self, x, op="sum", algo="auto", out=None):
        if not needs_staging(x, out, reduction=True):
            return self.comm.ireduce_scatter(x, op, algo, out=out)
        return _Then(self.comm.ireduce_scatter(to_host(x), op, algo), lambda h: _land(out, x, h))

    def iallgather(self, x, out=None, algo="auto"):
        if not needs_staging(x, out):
            return self.comm.iallgather(x, out=out, algo=algo)
        return _Then(self.comm.iallgather(to_host(x), algo=algo), lambda h: _land(out, x, h))

    def ibroadcast(self, x, root=0, algo="auto"):
        if not needs_staging(x):
            return self.comm.ibroadcast(x, root, algo)
        return _Then(self.comm.ibroadcast(to_host(x), root, algo), lambda h: copy_back(x, h))

    def ialltoall(self, x, out=None, algo="auto"):
        if not needs_staging(x, out):
            return self.comm.ialltoall(x, out=out, algo=algo)
        return _Then(self.comm.ialltoall(to_host(x), algo=algo), lambda h: _land(out, x, h))

    def ialltoallv(self, x, send_counts, recv_counts=None, out=None):
        if not needs_staging(x, out):
            return self.comm.ialltoallv(x, send_counts, recv_counts, out=out)
        return _Then(self.comm.ialltoallv(to_host(x), send_counts, recv_counts),
                     lambda res: (_land(out, x, res[0]), res[1]))

    # --- point to point (send, recv, sendrecv and isendrecv are Communicator's, over these) -----
    def isend(self, x, dest, tag=0):
        return self.comm.isend(to_host(x) if needs_staging(x) else x, dest, tag)

    def irecv(self, buf, source, tag=0):
        if not needs_staging(buf):
            return self.comm.irecv(buf, source, tag)
        host = np.empty(buf.shape, dtype=buf.dtype)      # the landing buffer, copied back on completion
        return _Then(self.comm.irecv(host, source, tag), lambda h: copy_back(buf, h))

    def __repr__(self):
        return f"HostStaging({self.comm!r})"


def _into(x, out, inplace):
    """Where an allreduce's result lands: out, else x itself (in place), else nowhere (a new array)."""
    return out if out is not None else (x if inplace else None)


def _land(dst, x, host):
    """A host result on the device: written into dst when given, else a new array on x's device."""
    return copy_back(dst, host) if dst is not None else backend.xp_of(x).asarray(host)


class _Then:
    """A request whose result goes through ``then`` once (the copy back to the device)."""

    def __init__(self, req, then):
        self._req, self._then, self._done, self._result = req, then, False, None

    def test(self):
        if not self._done and self._req.test():
            self._result, self._done = self._then(self._req.wait()), True
        return self._done

    def wait(self):
        if not self._done:
            self._result, self._done = self._then(self._req.wait()), True
        return self._result
