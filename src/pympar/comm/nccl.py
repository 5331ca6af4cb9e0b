"""NCCLComm: the Communicator over NCCL (cupy.cuda.nccl), bootstrapped over MPI.

Rank 0 of the MPI communicator makes the NCCL unique id and broadcasts it; every rank
then joins one NCCL communicator on its current CUDA device. Operations are enqueued on
the communicator's own stream after it waits for the caller's current stream, and a
blocking verb polls that stream against the deadline (CommTimeoutError, then the NCCL
communicator is aborted). alltoall/alltoallv are grouped send/recv; alltoallv exchanges
its counts over MPI first when they are not given. Written for GPUs; the test suite runs
it only where CuPy sees a device (docs/comm.md says what has run).
"""
from __future__ import annotations

import math
import time

import numpy as np

from .. import backend
from .base import Communicator, check_op, check_out, contiguous, flat, row_bounds
from .dtypes import finish_avg
from .errors import CommTimeoutError
from .progress import DoneRequest, default_timeout


def _nccl():
    cp = backend.cupy_or_none()
    if cp is None:
        raise RuntimeError("NCCLComm needs CuPy and a visible GPU; use MPIComm on the CPU")
    from cupy.cuda import nccl

    return cp, nccl


class _StreamRequest(DoneRequest):
    """Completes when the communicator's stream has passed an event recorded after the op."""

    def __init__(self, comm, op, result, finish=None):
        super().__init__(result)
        self._done = False
        self._comm, self._op, self._finish = comm, op, finish
        self._event = comm._cp.cuda.Event(disable_timing=True)
        self._event.record(comm.stream)

    def test(self):
        if not self._done and self._event.done:
            self._done = True
            if self._finish:
                self._finish()
        return self._done

    def wait(self):
        deadline = time.monotonic() + self._comm.timeout if math.isfinite(self._comm.timeout) else math.inf
        sleep = 1e-5
        while not self.test():
            self._comm.mpi.progress()    # MPI transfers this rank owes (pipeline sends) keep moving
            if time.monotonic() > deadline:
                self._comm.abort()
                raise CommTimeoutError(self._op, self._comm.name, self._comm.seq, [], self._comm.timeout,
                                       "NCCL kernel did not finish; communicator aborted")
            time.sleep(sleep)
            sleep = min(2 * sleep, 1e-3)
        return self._result


class NCCLComm(Communicator):
    """NCCLComm(mpi_comm=None): NCCL over the ranks of an MPIComm or mpi4py comm (world)."""

    def __init__(self, mpi_comm=None, name=None, timeout=None):
        cp, nccl = _nccl()
        from .mpi import MPIComm, world

        self.mpi = world() if mpi_comm is None else (mpi_comm if isinstance(mpi_comm, MPIComm) else MPIComm(mpi_comm))
        self._cp, self._nccl = cp, nccl
        self.rank, self.size = self.mpi.rank, self.mpi.size
        self._defer = False               # set by _nonblocking: _end returns the request
        self.name = name or f"nccl:{self.mpi.name}"
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.seq = 0
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi.mpi_comm.bcast(uid, 0)   # a tuple of ints: the id, not array data
        self.nc = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.int32): nccl.NCCL_INT32,
                       np.dtype(np.int64): nccl.NCCL_INT64}
        if backend.bfloat16 is not None and hasattr(nccl, "NCCL_BFLOAT16"):
            self._types[backend.bfloat16] = nccl.NCCL_BFLOAT16
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN, "prod": nccl.NCCL_PROD,
                     "avg": getattr(nccl, "NCCL_AVG", nccl.NCCL_SUM)}

    # --- plumbing ---------------------------------------------------------------------
    def _t(self, a):
        try:
            return self._types[np.dtype(a.dtype)]
        except KeyError:
            raise TypeError(f"dtype {a.dtype} has no NCCL type here: expected one of {sorted(map(str, self._types))}") from None

    def _raw(self, a):
        """(count, NCCL type) that moves a's bytes unchanged (gather, broadcast, send/recv): its own
        type, or bytes for a type NCCL cannot name here (bfloat16 before NCCL_BFLOAT16, bool)."""
        t = self._types.get(np.dtype(a.dtype))
        if t is not None:
            return a.size, t
        return a.nbytes, self._nccl.NCCL_UINT8

    def _dev(self, a, what):
        if not backend.is_cupy(a):
            raise TypeError(f"{what}: NCCLComm takes CuPy arrays (got {type(a).__name__}); use MPIComm for host arrays")
        return contiguous(a, what)

    def _begin(self, op):
        self.seq += 1
        ev = self._cp.cuda.Event(disable_timing=True)
        ev.record(self._cp.cuda.get_current_stream())
        self.stream.wait_event(ev)     # the caller's writes come first
        return op

    def _end(self, op, result, finish=None, blocking=True):
        req = _StreamRequest(self, op, result, finish)
        return req.wait() if blocking and not self._defer else req

    def _nonblocking(self, verb, *args, **kwargs):
        """Run a blocking verb without its final wait: the request of its stream event."""
        self._defer = True
        try:
            return getattr(self, verb)(*args, **kwargs)
        finally:
            self._defer = False

    def _avg_fix(self, op, a):
        if op == "avg" and not hasattr(self._nccl, "NCCL_AVG"):
            return lambda: finish_avg(a, self.size)
        if op == "avg" and a.dtype.kind in "iu":
            raise ValueError("op='avg' on integers is not supported by NCCL: use 'sum' and divide")
        return None

    def abort(self):
        try:
            self.nc.abort()
        except Exception:
            pass

    # --- collectives ------------------------------------------------------------------------
    def allreduce(self, x, op="sum", algo="auto", out=None, inplace=True, blocking=True, reproducible=False):
        if reproducible:
            raise ValueError("reproducible=True runs on the host MPI communicator (integer bins): call it there "
                             "with host arrays; the NCCL communicator does not build it")
        check_op(op)
        x = self._dev(x, "allreduce operand")
        dst = check_out(out, x.shape, x.dtype, "allreduce") if out is not None else (x if inplace else self._cp.empty_like(x))
        self._begin("allreduce")
        self.nc.allReduce(x.data.ptr, dst.data.ptr, x.size, self._t(x), self._ops[op], self.stream.ptr)
        return self._end("allreduce", dst, self._avg_fix(op, dst), blocking)

    def iallreduce(self, x, op="sum", algo="auto", out=None, inplace=True):
        return self.allreduce(x, op, algo, out, inplace, blocking=False)

    # the other nonblocking verbs: NCCL kernels are asynchronous on self.stream already
    def ireduce_scatter(self, x, op="sum", algo="auto", out=None):
        return self._nonblocking("reduce_scatter", x, op, algo, out)

    def iallgather(self, x, out=None, algo="auto"):
        return self._nonblocking("allgather", x, algo, out)

    def ibroadcast(self, x, root=0, algo="auto"):
        return self._nonblocking("broadcast", x, root, algo)

    def ialltoall(self, x, out=None, algo="auto"):
        return self._nonblocking("alltoall", x, out, algo)

    def ialltoallv(self, x, send_counts, recv_counts=None, out=None):
        req, rc = self._nonblocking("alltoallv", x, send_counts, recv_counts, out)
        req._result = (req._result, rc)
        return req

    def isendrecv(self, x, dest, buf, source, sendtag=0, recvtag=None):
        return self._nonblocking("sendrecv", x, dest, buf, source, sendtag, recvtag)

    def reduce_scatter(self, x, op="sum", algo="auto", out=None, reproducible=False):
        if reproducible:
            raise ValueError("reproducible=True runs on the host MPI communicator (integer bins): call it there "
                             "with host arrays; the NCCL communicator does not build it")
        check_op(op)
        x = self._dev(x, "reduce_scatter operand")
        E, R = row_bounds(x, self.size)
        shape = (R[self.rank + 1] - R[self.rank],) + tuple(x.shape[1:])
        out = check_out(out, shape, x.dtype, "reduce_scatter") if out is not None else self._cp.empty(shape, x.dtype)
        self._begin("reduce_scatter")
        if x.size % self.size == 0 and all(E[i + 1] - E[i] == x.size // self.size for i in range(self.size)):
            self.nc.reduceScatter(x.data.ptr, out.data.ptr, out.size, self._t(x), self._ops[op], self.stream.ptr)
        else:   # uneven blocks: NCCL's reduce-scatter needs equal ones
            tmp = self._cp.empty_like(x)
            self.nc.allReduce(x.data.ptr, tmp.data.ptr, x.size, self._t(x), self._ops[op], self.stream.ptr)
            with self.stream:
                flat(out)[...] = flat(tmp)[E[self.rank]:E[self.rank + 1]]
            avg = self._avg_fix(op, out)      # tmp stays alive until the stream is past the copy
            return self._end("reduce_scatter", out, lambda: (tmp, avg and avg()))
        return self._end("reduce_scatter", out, self._avg_fix(op, out))

    def allgather(self, x, algo="auto", out=None):
        x = self._dev(x, "allgather operand")
        x = x.reshape(1) if x.ndim == 0 else x
        shape = (self.size * x.shape[0],) + tuple(x.shape[1:])
        out = check_out(out, shape, x.dtype, "allgather") if out is not None else self._cp.empty(shape, x.dtype)
        self._begin("allgather")
        self.nc.allGather(x.data.ptr, out.data.ptr, *self._raw(x), self.stream.ptr)
        return self._end("allgather", out)

    def broadcast(self, x, root=0, algo="auto"):
        x = self._dev(x, "broadcast operand")
        self._begin("broadcast")
        self.nc.bcast(x.data.ptr, *self._raw(x), root, self.stream.ptr)
        return self._end("broadcast", x)

    def _exchange(self, op, sends, recvs):
        """Grouped point-to-point: sends/recvs are lists of (peer, array)."""
        nccl = self._nccl
        self._begin(op)
        nccl.groupStart()
        for peer, a in sends:
            if a.size:
                self.nc.send(a.data.ptr, *self._raw(a), peer, self.stream.ptr)
        for peer, a in recvs:
            if a.size:
                self.nc.recv(a.data.ptr, *self._raw(a), peer, self.stream.ptr)
        nccl.groupEnd()

    def alltoall(self, x, out=None, algo="auto"):
        x = self._dev(x, "alltoall operand")
        if x.ndim == 0 or x.shape[0] % self.size:
            raise ValueError(f"alltoall: x has {x.shape[0] if x.ndim else 0} rows, not a multiple of size={self.size}")
        out = check_out(out, x.shape, x.dtype, "alltoall") if out is not None else self._cp.empty_like(x)
        m = x.shape[0] // self.size
        self._exchange("alltoall", [(j, x[j * m:(j + 1) * m]) for j in range(self.size)],
                       [(j, out[j * m:(j + 1) * m]) for j in range(self.size)])
        return self._end("alltoall", out)

    def alltoallv(self, x, send_counts, recv_counts=None, out=None):
        x = self._dev(x, "alltoallv operand")
        sc = np.asarray(backend.to_numpy(send_counts), dtype=np.int64).reshape(-1)
        if sc.size != self.size or (sc < 0).any() or sc.sum() != x.shape[0]:
            raise ValueError(f"alltoallv: send_counts {sc.tolist()} must have size={self.size} non-negative entries "
                             f"summing to x.shape[0]={x.shape[0]}")
        if recv_counts is None:   # counts travel over MPI, on the host
            rc = self.mpi.alltoall(sc, algo="mpi")
        else:
            rc = np.asarray(backend.to_numpy(recv_counts), dtype=np.int64).reshape(-1)
        shape = (int(rc.sum()),) + tuple(x.shape[1:])
        out = check_out(out, shape, x.dtype, "alltoallv") if out is not None else self._cp.empty(shape, x.dtype)
        so = np.concatenate([[0], np.cumsum(sc)])
        ro = np.concatenate([[0], np.cumsum(rc)])
        self._exchange("alltoallv", [(j, x[so[j]:so[j + 1]]) for j in range(self.size)],
                       [(j, out[ro[j]:ro[j + 1]]) for j in range(self.size)])
        return self._end("alltoallv", out), rc

    def barrier(self):
        one = self._cp.zeros(1, self._cp.float32)
        self.allreduce(one)

    # --- point to point ------------------------------------------------------------------------
    def isend(self, x, dest, tag=0):
        x = self._dev(x, "send operand")
        self._exchange("send", [(dest, x)], [])
        return self._end("send", x, blocking=False)

    def irecv(self, buf, source, tag=0):
        buf = self._dev(buf, "recv buffer")
        self._exchange("recv", [], [(source, buf)])
        return self._end("recv", buf, blocking=False)

    def sendrecv(self, x, dest, buf, source, sendtag=0, recvtag=None):
        self._exchange("sendrecv", [(dest, self._dev(x, "send operand"))], [(source, self._dev(buf, "recv buffer"))])
        return self._end("sendrecv", buf)

    def split(self, color, key=None, name=None):
        sub = self.mpi.split(color, key, name=None if name is None else f"{name}:mpi")
        return None if sub is None else NCCLComm(sub, name=name or f"{self.name}/{color}", timeout=self.timeout)
