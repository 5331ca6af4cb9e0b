"""MPIComm: the Communicator over any mpi4py communicator, with pympar's algorithms.

Arrays travel through mpi4py's buffer interface (uppercase methods), never pickle. The
wrapped communicator is duplicated twice: one copy carries the user's point-to-point
verbs, the other pympar's collective algorithms, so neither can match the other's
messages nor the messages of the program that owns the original communicator.
"""
from __future__ import annotations

import itertools
import math
import time

import numpy as np
from mpi4py import MPI

from .. import backend
from .algorithms.doubling import (doubling_allgather, halving_reduce_scatter,
                                  rabenseifner_allreduce, recursive_doubling_allreduce)
from .algorithms.broadcast import binomial_broadcast, scatter_allgather_broadcast
from .algorithms.hierarchical import hierarchical_allgather, hierarchical_allreduce, hierarchical_reduce_scatter
from .algorithms.p2p import Ctx
from .algorithms.ring import (ring_allgather, ring_allgather_steps, ring_allreduce, ring_allreduce_steps,
                              ring_reduce_scatter, ring_reduce_scatter_steps)
from .algorithms.shm import ShmArena, shm_allgather, shm_allreduce, shm_broadcast, shm_reduce_scatter
from .base import Communicator, check_op, check_out, contiguous, flat, new_like, row_bounds
from .device import cuda_aware_mpi, needs_staging, sync_stream
from .dtypes import check_dtype, finish_avg, mpi_op, reduce_op, wire
from .plans import MAX_PLANS, Plan
from .progress import P2PRequest, Request, StagedRequest, Waiter, default_timeout, poll1
from .topology import Topology
from .tuning import Decision, Tuner, measure, read_setting, shape_key
from .verbs import ALGOS, VERBS
from .watchdog import SLOT, ArrivalBoard, deadline_guard, op_code
from . import debug as _debug
from . import fastcoll

_P2P_ALLREDUCE = {"ring": ring_allreduce, "recursive_doubling": recursive_doubling_allreduce,
                  "rabenseifner": rabenseifner_allreduce}
_P2P_REDUCE_SCATTER = {"ring": ring_reduce_scatter, "recursive_halving": halving_reduce_scatter}
_P2P_ALLGATHER = {"ring": ring_allgather, "recursive_doubling": doubling_allgather}
_P2P_BROADCAST = {"binomial": binomial_broadcast, "scatter_allgather": scatter_allgather_broadcast}
_SHM = ("shm", "hierarchical")
_REDUCING = tuple(v for v in ALGOS if VERBS[v].reducing)
_READ = object()      # MPIComm(_tuning=...) not given: read $PYMPAR_TUNING
_KEEP_ARENA = 1 << 20  # a window the measurement made is kept up to this size (making one is collective and slow)
_ndarray = np.ndarray
_run_c = fastcoll.run
_U64 = (1 << 64) - 1           # a handle as mpi4py takes it (unsigned)
_TOKENS = itertools.count(1)   # a communicator's token on the deadline guard's slot
_FAST = {v: f"_fast_{v}" for v in fastcoll.VERBS}   # verb -> the attribute holding its last C plan


class MPIComm(Communicator):
    """``MPIComm(comm)`` wraps an mpi4py communicator (COMM_WORLD when None).

    timeout: seconds a collective or a point-to-point wait may take (default
    $PYMPAR_COMM_TIMEOUT or 300; math.inf disables); a point-to-point wait past it raises
    CommTimeoutError.
    on_timeout: "abort" (the default, as torch's and NCCL's watchdogs end a stalled job): past
    its deadline a collective's report (who did not arrive) goes to stderr and MPI_Abort ends every
    rank. It lets auto choose the library's *blocking* collective ("blocking"), whose deadline
    a watchdog thread keeps (a blocking MPI call cannot return early; only the job can end).
    "raise": a CommTimeoutError in the caller instead; every call is then polled, never the
    library's blocking one (the same speed with ranks <= cores; slower when the node's ranks
    outnumber its cores, where the library's blocking wait yields the core better).
    """

    def __init__(self, comm=None, name=None, timeout=None, _owned=False, _tuning=_READ, on_timeout="abort"):
        if on_timeout not in ("raise", "abort"):
            raise ValueError(f"on_timeout={on_timeout!r}: expected 'raise' or 'abort'")
        self.on_timeout = on_timeout
        comm = MPI.COMM_WORLD if comm is None else comm
        self._p2p = comm if _owned else comm.Dup()
        self._coll = self._p2p.Dup()
        self.rank, self.size = self._p2p.Get_rank(), self._p2p.Get_size()
        self.name = name or comm.Get_name() or "comm"
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self._count = memoryview(bytearray(8)).cast("q")   # [seq]: Python and the C path count here
        self._token = next(_TOKENS)
        self._inflight = []   # unfinished nonblocking operations run by pympar (progress.StagedRequest)
        # the tags pympar's nonblocking algorithms draw from: 1..TAG_UB (MPI guarantees >= 32767;
        # MPICH 5 gives 2^29 - 1), one per call, so calls in flight together never share one
        ub = self._coll.Get_attr(MPI.TAG_UB)
        self._tag_span = int(ub) if ub else 32767
        self.p2p_seq = 0
        self._topo = self._arena = None
        # auto's source ($PYMPAR_TUNING, tuning.read_setting): rank 0 reads it, every rank gets it
        self._setting = _tuning if _tuning is not _READ else self._p2p.bcast(read_setting() if self.rank == 0 else None, 0)
        self._tuner = None    # tuning.Tuner, made with the topology on the first auto call
        self._guard = deadline_guard() if on_timeout == "abort" else None   # keeps "blocking" calls' deadlines
        if self._guard is not None:
            self._guard.watch(self._token, self)
        self._abort_token = self._token if self._guard is not None else 0   # collectives' waits may block (progress.Waiter)
        self._timer = None    # tuning.measure's timer(name, run) -> seconds (None: perf_counter)
        # watchdog side channels (shadow communicators): who entered which call; debug fingerprints
        self._board = ArrivalBoard(self._coll, self.name, self.timeout)
        self._board.abort = on_timeout == "abort"
        self._fp = _debug.FingerprintChecker(self._coll, self.name) if _debug.enabled() else None
        self._plans = {}      # (verb, dtype, shape, op|root, algo) -> plans.Plan: the per-call fast path
        self._drop_native()   # _fast_<verb>: the C form of the verb's last planned call (fastcoll.py)
        fastcoll.library()    # found once per process, when the first communicator is made
        self._board.on_free.append(self._drop_native)

    @property
    def seq(self) -> int:
        """Collectives issued on this communicator (the same on every rank)."""
        return self._count[0]

    @seq.setter
    def seq(self, v):
        self._count[0] = v

    def _drop_native(self):
        """Forget the C forms of the plans (they hold the arrival board's memory address)."""
        for a in _FAST.values():
            setattr(self, a, None)
        for p in self._plans.values():
            p.native = None

    @property
    def mpi_comm(self):
        """The mpi4py communicator carrying this object's point-to-point traffic."""
        return self._p2p

    # --- plumbing ----------------------------------------------------------------
    def _deadline(self, op, seq):
        """The Waiter of collective #seq: its deadline, the board naming who did not arrive, and --
        on an on_timeout="abort" communicator -- the guard's token that lets a long wait block
        inside the library (progress.Waiter)."""
        return Waiter(op, self.name, seq, self.timeout, self._board, self._abort_token)

    def _waiter(self, op, x=None, count=None, root=-1, tagged=False):
        """The deadline of collective #seq; marks this rank's arrival on the board.

        x/count/root: the fingerprint compared across ranks in debug mode (count defaults to x.size).
        tagged: a nonblocking call of pympar's algorithms (its messages carry _nonblocking_tag):
        refused here, before it counts, when an unfinished earlier one still holds its tag."""
        if tagged and self._inflight:
            self._check_tag_free(op)
        self.seq += 1
        self._board.enter(self.seq, op)
        w = self._deadline(op, self.seq)
        if self._fp is not None:
            n = count if count is not None else (int(x.size) if x is not None else 0)
            self._fp.check(op, self.seq, n, None if x is None else x.dtype, root, w)
        return w

    def topology(self) -> Topology:
        """Node structure (collective on first use: every rank must ask at the same call)."""
        if self._topo is None:
            self._topo = Topology(self._coll)
        return self._topo

    def _shm_arena(self):
        if self._arena is None:
            t = self.topology()
            self._arena = ShmArena(t.node, t.node_to_comm)
        return self._arena

    def _check_algo(self, coll, algo):
        if algo == "blocking":
            self._blocking_ok()
        elif algo != "auto" and algo not in ALGOS[coll]:
            raise ValueError(f"unknown {coll} algorithm {algo!r}: expected auto or one of {', '.join(ALGOS[coll])}")

    def _blocking_ok(self):
        if self.on_timeout != "abort":
            raise ValueError("algo='blocking' (the library's blocking call) cannot raise CommTimeoutError at its "
                             "deadline: make the communicator with on_timeout='abort' (the job ends with the report "
                             "instead), or use algo='mpi' (the library's nonblocking call, polled)")

    def _pick(self, coll, algo):
        """A named algorithm (not auto) checked against the verb and the topology."""
        self._check_algo(coll, algo)
        if algo == "shm" and not self.topology().single_node:
            raise ValueError(f"algo='shm' needs every rank of {self.name!r} on one node "
                             f"(it spans {self.topology().n_nodes}); use 'hierarchical' or 'auto'")
        return algo

    # --- algo="auto" (tuning.py): the tuning file, or an agreed measurement per size bucket ------
    def candidates(self, coll):
        """What auto chooses from for ``coll`` here: the library's call ('mpi') first, then
        pympar's algorithms the topology allows (shm on one node only; hierarchical only across
        nodes of which one has more than one rank -- otherwise it is shm or a ring); with
        on_timeout='abort' also the library's blocking call ('blocking')."""
        t = self.topology()
        out = ["mpi", "blocking"] if self.on_timeout == "abort" else ["mpi"]
        for a in ALGOS[coll]:
            if a == "mpi" or (a == "shm" and not t.single_node):
                continue
            if a == "hierarchical" and (t.single_node or t.max_node_size == 1):
                continue
            out.append(a)
        return out

    def shape_key(self):
        """This communicator's shape as tuning files name it ('4r-2n-2rpn': ranks, nodes, most
        ranks on a node); collective on first use (the topology)."""
        t = self.topology()
        return shape_key(self.size, t.n_nodes, t.max_node_size, t.uniform)

    def _tuning(self):
        if self._tuner is None:
            grp, wgrp = self._coll.Get_group(), MPI.COMM_WORLD.Get_group()
            members = grp.Translate_ranks(list(range(self.size)), wgrp)
            grp.Free()
            wgrp.Free()
            self._tuner = Tuner(self._setting, self.shape_key(), self.name, warn=self.rank == 0,
                                members=members, on_timeout=self.on_timeout)
        return self._tuner

    def _auto(self, verb, x, dst, nbytes, out_shape, op=None, root=0, E=None):
        """auto's decision for this call (collective when the bucket is new: every rank of the
        communicator is in the same call). Measures on the call's own operands: x is only read
        and dst is written by the real call afterwards; an in-place allreduce gets a scratch dst."""
        cands = self.candidates(verb)
        tuner = self._tuning()
        d = tuner.lookup(verb, x.dtype, nbytes, cands)
        if d is not None:
            return d
        w = self._deadline(verb, self.seq)   # the call's own deadline and board entry
        if not self._same_call(w, verb, x, nbytes, root):
            # the ranks are not in the same call (an erroneous program): measure nothing, run the
            # library's call as a program without auto would, and decide nothing for the bucket
            return Decision(verb, x.dtype, nbytes, tuner.shape, "mpi", "mismatch")
        if dst is x and verb == "allreduce":
            dst = np.empty_like(x)
        had_arena = self._arena is not None
        sel = op if verb in _REDUCING else (root if verb == "broadcast" else None)
        runs = {a: self._measured(Plan(verb, a, x.dtype, out_shape, _OWN[verb], self._coll, op, root, E), x, dst, w, sel)
                for a in cands}
        count, slots = self._count, self._board.slots
        before = (count[0], slots[0], slots[1])
        times = measure(cands, runs, self._coll, nbytes, self._timer, w)
        count[0], slots[0], slots[1] = before      # the measured calls (C path) counted: this call is one
        d = tuner.record(verb, x.dtype, nbytes, times)
        if (not had_arena and self._arena is not None and d.algo not in _SHM
                and self._arena.cap > _KEEP_ARENA):
            self._arena.free()    # the measurement made a large shared window that nothing uses
            self._arena = None
        return d

    def _measured(self, plan, x, dst, w, sel):
        """One call of a candidate as auto times it: as the real call will run -- the library's
        call through the C path where a planned call takes it (fastcoll.py), else by _run."""
        verb, algo = plan.verb, plan.algo
        nat = fastcoll.make(self, plan, x, (verb, x.dtype, x.shape, sel, algo)) if type(x) is _ndarray else None
        if nat is None:
            return lambda: self._run(plan, x, dst, w)
        out, inplace = (None, True) if verb == "broadcast" else (dst, False)

        def go():
            r = _run_c(nat, x, out, sel, algo, inplace)
            if r is None:
                self._run(plan, x, dst, w)
            elif r.__class__ is not _ndarray:
                self._c_finish(r, verb, dst)
        return go

    def _same_call(self, w, verb, x, nbytes, root):
        """Whether every rank is in this call (verb, dtype, size, root): one small library
        allreduce before a measurement, which would otherwise run pympar's algorithms on
        mismatched operands."""
        sig = np.array([op_code(verb), op_code(x.dtype.str), nbytes, root], np.int64)
        both = np.concatenate([sig, -sig])
        w.wait([self._coll.Iallreduce(MPI.IN_PLACE, both, MPI.MAX)], [None])
        return bool(np.array_equal(both[:4], -both[4:]))

    def explain(self, collective, nbytes, dtype="float32", op="sum"):
        """What ``algo="auto"`` runs for a ``collective`` of ``nbytes`` here, and why: a
        tuning.Decision (print it for the timings). Collective when the bucket was not decided
        yet (it is measured then, on zero-filled buffers, and kept for later calls)."""
        if collective not in ALGOS:
            raise ValueError(f"explain: unknown collective {collective!r}: expected one of {', '.join(ALGOS)}")
        dt = backend.dtype(dtype)
        n = max(int(nbytes) // dt.itemsize, 0)
        if self.size == 1:
            return Decision(collective, dt, n * dt.itemsize, "1r-1n-1rpn", "mpi", "only")
        if collective in ("allgather", "alltoall"):
            n -= n % self.size
        x = np.zeros(n // self.size if collective == "allgather" else n, dt)
        E = None
        if collective == "reduce_scatter":
            E, R = row_bounds(x, self.size)
            out = np.empty(R[self.rank + 1] - R[self.rank], dt)
        else:
            out = x if collective == "broadcast" else np.empty(n, dt)
        return self._auto(collective, x, out, n * dt.itemsize, out.shape, op if collective in _REDUCING else None,
                          0, E)

    def _ctx(self, waiter, op="sum", x=None, comm=None, nonblocking=False):
        sync = (lambda: sync_stream(x)) if backend.is_cupy(x) else None
        tag = self._nonblocking_tag(waiter) if nonblocking else 0     # blocking algorithms: tag 0
        if comm is None:   # this communicator: its rank and size are known, no MPI query
            return Ctx(self._coll, waiter, reduce_op(op), sync, tag, self.rank, self.size)
        return Ctx(comm, waiter, reduce_op(op), sync, tag)

    def _nonblocking_tag(self, waiter):
        """The tag of nonblocking call #waiter.seq's messages: 1 + (seq - 1) mod the tag space, so
        calls in flight together never match each other's messages."""
        return 1 + (waiter.seq - 1) % self._tag_span

    def _check_tag_free(self, op):
        """Refuse the next call when an unfinished call of this rank holds its tag (tag-space calls
        ago: a request never waited for). Only this rank's requests are known here; the ranks
        whose earlier call did finish go on into the call and their watchdog names it."""
        span, seq = self._tag_span, self.seq + 1
        for r in self._inflight:
            if r.tagged and (seq - r.seq) % span == 0:
                raise RuntimeError(f"{self.name}: nonblocking {op} #{seq} would reuse the message tag of #{r.seq}, "
                                   f"still unfinished {seq - r.seq} calls later (the MPI library's tag space is "
                                   f"1..{span}): wait for or test the earlier request")

    def _rs_operands(self, x, out, what):
        """reduce_scatter's checked operand, element bounds E of the ranks' blocks, and output."""
        self._passable(what, x, out, reduction=True)
        x = contiguous(x, f"{what} operand")
        if x.ndim == 0:
            raise ValueError(f"{what} needs an array with at least one dimension (split along axis 0)")
        E, R = row_bounds(x, self.size)
        shape = (R[self.rank + 1] - R[self.rank],) + tuple(x.shape[1:])
        out = check_out(out, shape, x.dtype, what) if out is not None else new_like(x, shape)
        return x, E, out

    def _passable(self, what, *arrays, reduction=False):
        """Refuse device operands this MPI library cannot take: pympar.comm.HostStaging is the
        communicator that stages them through the host (see device.needs_staging)."""
        if needs_staging(*arrays, reduction=reduction):
            why = "it is not CUDA-aware" if not cuda_aware_mpi() else \
                "MPI has no type for the reduction of " + ", ".join(sorted({str(a.dtype) for a in arrays if a is not None}))
            raise TypeError(f"{self.name}: {what} got a device (CuPy) operand this MPI library cannot take ({why}): "
                            f"wrap the communicator in pympar.comm.HostStaging (DeviceComm.mpi_only does), or use "
                            f"NCCL (pympar.comm.NCCLComm)")

    def _lib(self, waiter, start, finish=None, result=None):
        """Run a library collective (nonblocking, polled against the deadline)."""
        req = Request([start()], [None], waiter, finish, result)
        return req.wait()

    # --- collectives ---------------------------------------------------------------
    # The five blocking verbs are one path (_blocking) over a description of each (_OPERANDS:
    # its operand checks and output). A NumPy operand whose call key was planned before runs
    # by that plan (_planned, the fast path). Otherwise the general path stages device operands
    # through the host when the MPI library cannot take them, checks the operands, enters the
    # call on the arrival board (_waiter), picks the algorithm and makes the plan (_plan, kept
    # for the next call). Both paths then run the collective by the plan: the library's
    # nonblocking call it bound, or the verb's runner of pympar's algorithms (_run; the fast
    # path inlines the library branch).
    def allreduce(self, x, op="sum", algo="auto", out=None, inplace=True, reproducible=False):
        """op over ranks of x. out=None: in place into x (inplace=True) or a new array.
        reproducible=True: the same bits for the same operands, whatever the algorithm or the
        number of ranks (base._reproducible, comm/exact.py)."""
        if reproducible:
            return self._reproducible("allreduce", x, op, out, inplace)
        r = _run_c(self._fast_allreduce, x, out, op, algo, inplace)     # the C path (fastcoll.py)
        if r is not None:
            return r if r.__class__ is _ndarray else self._c_finish(r, "allreduce", x if out is None else out)
        return self._blocking("allreduce", x, out, algo, op=op, inplace=inplace)

    def reduce_scatter(self, x, op="sum", algo="auto", out=None, reproducible=False):
        """x (N, ...) -> this rank's rows [E[r], E[r+1]) of the reduction (see base.py)."""
        if reproducible:
            return self._reproducible("reduce_scatter", x, op, out)
        return self._blocking("reduce_scatter", x, out, algo, op=op)

    def allgather(self, x, algo="auto", out=None):
        """x (m, ...) on every rank -> (size*m, ...), rank k's rows at [k*m, (k+1)*m)."""
        r = _run_c(self._fast_allgather, x, out, None, algo, False)
        if r is not None:
            return r if r.__class__ is _ndarray else self._c_finish(r, "allgather", out)
        return self._blocking("allgather", x, out, algo)

    def broadcast(self, x, root=0, algo="auto"):
        """x of rank root copied into x on every rank (in place); returns x."""
        r = _run_c(self._fast_broadcast, x, None, root, algo, True)
        if r is not None:
            return r if r.__class__ is _ndarray else self._c_finish(r, "broadcast", x)
        return self._blocking("broadcast", x, None, algo, root=root, inplace=True)

    def alltoall(self, x, out=None, algo="auto"):
        """x (size*m, ...): rows [i*m, (i+1)*m) go to rank i; out[j*m:(j+1)*m] came from j."""
        r = _run_c(self._fast_alltoall, x, out, None, algo, False)
        if r is not None:
            return r if r.__class__ is _ndarray else self._c_finish(r, "alltoall", out)
        return self._blocking("alltoall", x, out, algo)

    def _c_finish(self, r, verb, dst):
        """The C path's other answers (fastcoll.cpp): (1, request) started and still running --
        waited for against the call's deadline; (2, request) the same after its yield phase;
        (0, code) the library's error."""
        kind, v = r
        if kind == 0:
            raise MPI.Exception(v)
        w = self._deadline(verb, self.seq)
        if kind == 2:                       # the yield phase's seconds passed before the Waiter was made
            w.deadline -= fastcoll.yield_seconds(self)
        w.wait([MPI.Request.fromhandle(v & _U64)], [None], kind == 2)
        return dst

    def _blocking(self, verb, x, out, algo, op=None, root=None, inplace=False):
        """The blocking path of every verb (see above). root: broadcast's, else None; the call
        key's fourth item is the op (reductions), the root (broadcast) or None."""
        sel = op if verb in _REDUCING else root
        if type(x) is _ndarray and self._fp is None:
            got = self._planned((verb, x.dtype, x.shape, sel, algo), x, out, inplace)
            if got is not None:
                return got
        if verb in _REDUCING:
            check_op(op)
        x, dst, E, nbytes = _OPERANDS[verb](self, x, out, inplace)
        self._check_algo(verb, algo)
        w = self._waiter(verb, x) if root is None else self._waiter(verb, x, root=root)
        if self.size == 1:
            if dst is not x:
                flat(dst)[...] = flat(x)
            return dst
        plan = self._plan((verb, x.dtype, x.shape, sel, algo), x, dst, nbytes, dst.shape, op=op,
                          root=0 if root is None else root, E=E)
        w.renew()        # the call's timeout counts from here: auto may have measured the bucket first
        return self._run(plan, x, dst, w)

    # each verb's operands: (x checked, dst, E (reduce_scatter's row bounds) or None, bytes auto decides on)
    def _allreduce_operands(self, x, out, inplace, what="allreduce"):
        self._passable(what, x, out, reduction=True)
        x = contiguous(x, f"{what} operand")
        dst = check_out(out, x.shape, x.dtype, what) if out is not None else (x if inplace else new_like(x, x.shape))
        return x, dst, None, x.nbytes

    def _reduce_scatter_operands(self, x, out, _inplace, what="reduce_scatter"):
        x, E, out = self._rs_operands(x, out, what)
        return x, out, E, x.nbytes

    def _allgather_operands(self, x, out, _inplace, what="allgather"):
        self._passable(what, x, out)
        x = contiguous(x, f"{what} operand")
        if x.ndim == 0:
            x = x.reshape(1)
        shape = (self.size * x.shape[0],) + tuple(x.shape[1:])
        out = check_out(out, shape, x.dtype, what) if out is not None else new_like(x, shape)
        return x, out, None, out.nbytes

    def _broadcast_operands(self, x, _out, _inplace, what="broadcast"):
        self._passable(what, x)
        x = contiguous(x, f"{what} operand")
        return x, x, None, x.nbytes

    def _alltoall_operands(self, x, out, _inplace, what="alltoall"):
        self._passable(what, x, out)
        x = contiguous(x, f"{what} operand")
        if x.ndim == 0 or x.shape[0] % self.size:
            raise ValueError(f"{what}: x has {x.shape[0] if x.ndim else 0} rows, not a multiple of size={self.size}")
        out = check_out(out, x.shape, x.dtype, what) if out is not None else new_like(x, x.shape)
        return x, out, None, x.nbytes

    # --- plans: the one mechanism behind the five verbs above (see plans.py) ----------------
    def _plan(self, key, x, dst, nbytes, out_shape, op=None, root=0, E=None):
        """The Plan of a checked call (x into dst) whose key is (verb, dtype, shape, op|root,
        algo): the algorithm named, or auto's for nbytes; kept for NumPy operands outside debug mode."""
        verb, algo = key[0], key[-1]
        if algo != "auto":
            chosen = self._pick(verb, algo)
        elif backend.is_cupy(x):   # device buffers (CUDA-aware MPI): the library's call
            chosen = "mpi"
        else:
            chosen = self._auto(verb, x, dst, nbytes, out_shape, op, root, E).algo
        if backend.is_cupy(x) and chosen in _SHM:
            # the shared window is host memory; CUDA-aware MPI moves device buffers
            chosen = "mpi" if verb == "broadcast" else "ring"
        plan = Plan(verb, chosen, x.dtype, out_shape, _OWN[verb], self._coll, op, root, E)
        if type(x) is _ndarray and self._fp is None and len(self._plans) < MAX_PLANS:
            self._plans[key] = plan
            plan.native = fastcoll.make(self, plan, x, key)
            if plan.native is not None:
                setattr(self, _FAST[verb], plan.native)
        return plan

    def _planned(self, key, x, out=None, inplace=False):
        """The fast path: run a NumPy call by the plan kept under key, or None (no plan, or an
        operand the plan does not fit: the general path then checks it and raises).

        What the general path checks is in the key (dtype, shape, op, algo were accepted) or
        checked here (contiguity, out's type, dtype, shape); no debug fingerprint (the caller
        tests self._fp). The call is counted and entered on the arrival board as _waiter does;
        the deadline object is built only when a wait is not short (progress.poll1)."""
        plan = self._plans.get(key)
        if plan is None or not x.flags.c_contiguous:
            return None
        if plan.native is not None:    # the next call of this key takes the C path
            setattr(self, _FAST[plan.verb], plan.native)
        if out is None:
            dst = x if inplace and plan.in_place else np.empty(plan.out_shape, x.dtype)
        elif (type(out) is _ndarray and out.dtype is x.dtype and out.shape == plan.out_shape
              and out.flags.c_contiguous):     # dtype: the same object, else the general path compares
            dst = out
        else:
            return None
        count = self._count
        seq = count[0] = count[0] + 1
        slots = self._board.slots     # ArrivalBoard.enter(seq, verb), inlined
        slots[1] = plan.code
        slots[0] = seq
        if plan.algo == "blocking":      # _run's blocking branch, inlined
            SLOT[1] = seq             # the deadline guard's slot (watchdog.DeadlineGuard; a new seq)
            SLOT[0] = self._token
            plan.call(x, dst)
            SLOT[0] = 0
            if plan.avg:
                finish_avg(dst.reshape(-1), self.size)
            return dst
        if plan.algo != "mpi":
            return self._run(plan, x, dst, self._deadline(plan.verb, seq))
        # _run's library branch, inlined (a Python call less: ~0.3 us of a ~3 us collective)
        req = plan.start(x, dst)
        if not req.Test():
            poll1(req, lambda: self._deadline(plan.verb, seq))
        if plan.avg:
            finish_avg(dst.reshape(-1), self.size)
        return dst

    def _run(self, plan, x, dst, w):
        """Run the call that w waits for (entered on the board) of x into dst by plan; returns dst."""
        if plan.algo == "mpi":
            sync_stream(x)
            w.wait([plan.start(x, dst)], [None])
            if plan.avg:
                finish_avg(flat(dst), self.size)
        elif plan.algo == "blocking":
            sync_stream(x)
            SLOT[2] = w.gen
            SLOT[1] = w.seq
            SLOT[0] = self._token
            plan.call(x, dst)
            SLOT[0] = 0
            if plan.avg:
                finish_avg(flat(dst), self.size)
        else:
            plan.own(self, w, plan, x, dst)
        return dst

    # --- pympar's own algorithms of each verb (plan.own), x into dst ---------------------------
    def _leaders(self, w, op, x):
        """(topology, context of the node leaders' communicator or None): hierarchical's inputs."""
        t = self.topology()
        return t, (self._ctx(w, op, x, t.leaders) if t.leaders is not None else None)

    def _allreduce_own(self, w, plan, x, dst):
        src_f, dst_f, algo, op = flat(x), flat(dst), plan.algo, plan.op
        if algo == "shm":
            shm_allreduce(self._shm_arena(), w, src_f, dst_f, op)
        elif algo == "hierarchical":
            _, lctx = self._leaders(w, op, x)
            hierarchical_allreduce(self._shm_arena(), lctx, w, src_f, dst_f, op, self.size)
        else:
            if dst is not x:
                dst_f[...] = src_f
            _P2P_ALLREDUCE[algo](self._ctx(w, op, x), dst_f)
            if op == "avg":
                finish_avg(dst_f, self.size)

    def _reduce_scatter_own(self, w, plan, x, out):
        src_f, out_f, algo, op, E = flat(x), flat(out), plan.algo, plan.op, plan.E
        if algo == "shm":
            shm_reduce_scatter(self._shm_arena(), w, src_f, out_f, E, op)
        elif algo == "hierarchical":
            t, lctx = self._leaders(w, op, x)
            hierarchical_reduce_scatter(self._shm_arena(), t, lctx, w, src_f, out_f, E, op, self.size)
        else:
            work = src_f.copy()
            _P2P_REDUCE_SCATTER[algo](self._ctx(w, op, x), work, E)
            out_f[...] = work[E[self.rank]:E[self.rank + 1]]
            if op == "avg":
                finish_avg(out_f, self.size)

    def _allgather_own(self, w, plan, x, out):
        src_f, out_f, algo = flat(x), flat(out), plan.algo
        if algo == "shm":
            shm_allgather(self._shm_arena(), w, src_f, out_f)
        elif algo == "hierarchical":
            t, lctx = self._leaders(w, "sum", x)
            hierarchical_allgather(self._shm_arena(), t, lctx, w, src_f, out_f, self.size)
        else:
            m = src_f.size
            out_f[self.rank * m:(self.rank + 1) * m] = src_f
            _P2P_ALLGATHER[algo](self._ctx(w, "sum", x), out_f, [k * m for k in range(self.size + 1)])

    def _broadcast_own(self, w, plan, x, _dst):
        if plan.algo == "shm":
            shm_broadcast(self._shm_arena(), w, flat(x), plan.root)
        else:
            _P2P_BROADCAST[plan.algo](self._ctx(w, "sum", x), flat(x), plan.root)

    def _alltoall_own(self, w, plan, x, out):
        """pairwise: n-1 simultaneous exchanges, rank r sending to r+k and receiving from r-k."""
        src_f, out_f = flat(x), flat(out)
        m, n, r = src_f.size // self.size, self.size, self.rank
        ctx = self._ctx(w, "sum", x)
        out_f[r * m:(r + 1) * m] = src_f[r * m:(r + 1) * m]
        reqs, peers = [], []
        for k in range(1, n):
            dst, src = (r + k) % n, (r - k) % n
            reqs += [ctx.irecv(out_f[src * m:(src + 1) * m], src), ctx.isend(src_f[dst * m:(dst + 1) * m], dst)]
            peers += [src, dst]
        w.wait(reqs, peers)

    def alltoallv(self, x, send_counts, recv_counts=None, out=None):
        """Send send_counts[i] rows of x (in order) to rank i -> (out, recv_counts).

        recv_counts=None: the counts are exchanged first (one alltoall of int64).
        """
        x, sc, per_row = self._v_operands(x, send_counts, "alltoallv", out)
        if recv_counts is None:
            rc = np.empty(self.size, dtype=np.int64)
            w0 = self._waiter("alltoallv.counts", sc)
            self._lib(w0, lambda: self._coll.Ialltoall([sc, MPI.INT64_T], [rc, MPI.INT64_T]))
        else:
            rc = np.asarray(backend.to_numpy(recv_counts), dtype=np.int64).reshape(-1)
        out, start = self._v_exchange(x, sc, rc, per_row, out, "alltoallv")
        w = self._waiter("alltoallv", x, count=per_row)
        sync_stream(x)
        self._lib(w, start)
        return out, rc

    def _v_operands(self, x, send_counts, what, out=None):
        """alltoallv's checked operand, its send counts (int64, one per rank) and elements per row."""
        self._passable(what, x, out)
        x = contiguous(x, f"{what} operand")
        sc = np.asarray(backend.to_numpy(send_counts), dtype=np.int64).reshape(-1)
        if sc.size != self.size or (sc < 0).any() or sc.sum() != (x.shape[0] if x.ndim else 0):
            raise ValueError(f"{what}: send_counts {sc.tolist()} must have size={self.size} non-negative "
                             f"entries summing to x.shape[0]={x.shape[0] if x.ndim else 0}")
        return x, sc, (int(np.prod(x.shape[1:])) if x.ndim > 1 else 1)

    def _v_exchange(self, x, sc, rc, per_row, out, what):
        """(the output (checked, or new) for recv counts rc, a function starting the library's
        Ialltoallv of the rows with their counts and displacements in elements)."""
        shape = (int(rc.sum()),) + tuple(x.shape[1:])
        out = check_out(out, shape, x.dtype, what) if out is not None else new_like(x, shape)
        scounts, rcounts = sc * per_row, rc * per_row
        sdis = np.concatenate([[0], np.cumsum(scounts)[:-1]])
        rdis = np.concatenate([[0], np.cumsum(rcounts)[:-1]])
        s, rb = wire(flat(x)), wire(flat(out))
        return out, lambda: self._coll.Ialltoallv([s[0], (scounts, sdis), s[1]], [rb[0], (rcounts, rdis), rb[1]])

    def barrier(self):
        w = self._waiter("barrier")
        self._lib(w, self._coll.Ibarrier)

    # --- nonblocking collectives ------------------------------------------------------
    # Each i-verb takes the blocking verb's operands and returns a Request whose wait() gives
    # what the blocking verb returns; test() progresses it. algo: "mpi" (auto: the library's
    # nonblocking collective) or "ring" (pympar's ring as a state machine; allreduce,
    # reduce_scatter, allgather). The operands must stay untouched until the request completes.
    # CuPy operands an MPI without CUDA support cannot take are refused (_passable): HostStaging
    # (pympar.comm.staging) is the communicator that copies them through the host.
    def _i_algo(self, verb, algo):
        """The nonblocking form's algorithm (pympar.comm.verbs: Verb.nonblocking); auto: the library's."""
        algo = "mpi" if algo == "auto" else algo
        ok = VERBS[verb[1:]].nonblocking
        if algo not in ok:
            raise ValueError(f"unknown {verb} algorithm {algo!r}: the nonblocking form takes one of "
                             f"{', '.join(('auto',) + ok)}")
        return algo

    def _staged(self, waiter, steps, finish=None, tagged=False):
        """A StagedRequest of this communicator; tagged: its messages carry _nonblocking_tag."""
        r = StagedRequest(steps, waiter, finish, self._inflight)
        r.tagged = tagged
        return r

    @staticmethod
    def _lib_steps(start, result):
        req = start()
        yield [req], [None]
        return result

    def iallreduce(self, x, op="sum", algo="auto", out=None, inplace=True):
        """Start allreduce(x, op, out=out, inplace=inplace); Request.wait() returns its result."""
        check_op(op)
        algo = self._i_algo("iallreduce", algo)
        x, dst, _, _ = self._allreduce_operands(x, out, inplace, "iallreduce")
        ring = algo == "ring" and self.size > 1          # pympar's ring: its messages carry a tag
        w = self._waiter("iallreduce", x, tagged=ring)
        src_f, dst_f = flat(x), flat(dst)
        fin = (lambda: finish_avg(dst_f, self.size)) if op == "avg" and self.size > 1 else None
        if self.size == 1 or algo == "ring":
            if dst is not x:
                dst_f[...] = src_f
            steps = ring_allreduce_steps(self._ctx(w, op, x, nonblocking=True), dst_f) if self.size > 1 else iter(())
            return self._staged(w, _then_return(steps, dst), fin, tagged=ring)
        sync_stream(x)
        send = MPI.IN_PLACE if dst is x else wire(src_f)
        return self._staged(w, self._lib_steps(
            lambda: self._coll.Iallreduce(send, wire(dst_f), mpi_op(op, x.dtype)), dst), fin)

    def ireduce_scatter(self, x, op="sum", algo="auto", out=None):
        """Start reduce_scatter(x, op, out=out): wait() returns this rank's rows of the reduction."""
        check_op(op)
        algo = self._i_algo("ireduce_scatter", algo)
        x, E, out = self._rs_operands(x, out, "ireduce_scatter")
        ring = algo == "ring" and self.size > 1
        w = self._waiter("ireduce_scatter", x, tagged=ring)
        src_f, out_f = flat(x), flat(out)
        fin = (lambda: finish_avg(out_f, self.size)) if op == "avg" and self.size > 1 else None
        if self.size == 1:
            out_f[...] = src_f
            return self._staged(w, _then_return(iter(()), out))
        if algo == "ring":
            work = src_f.copy()

            def steps():
                yield from ring_reduce_scatter_steps(self._ctx(w, op, x, nonblocking=True), work, E)
                out_f[...] = work[E[self.rank]:E[self.rank + 1]]
                return out
            return self._staged(w, steps(), fin, tagged=ring)
        sync_stream(x)
        counts = [E[i + 1] - E[i] for i in range(self.size)]
        return self._staged(w, self._lib_steps(
            lambda: self._coll.Ireduce_scatter(wire(src_f), wire(out_f), counts, mpi_op(op, x.dtype)), out), fin)

    def iallgather(self, x, out=None, algo="auto"):
        """Start allgather(x, out=out): wait() returns (size*m, ...)."""
        algo = self._i_algo("iallgather", algo)
        x, out, _, _ = self._allgather_operands(x, out, False, "iallgather")
        ring = algo == "ring" and self.size > 1
        w = self._waiter("iallgather", x, tagged=ring)
        src_f, out_f = flat(x), flat(out)
        m = src_f.size
        if self.size == 1 or algo == "ring":
            out_f[self.rank * m:(self.rank + 1) * m] = src_f
            E = [k * m for k in range(self.size + 1)]
            steps = ring_allgather_steps(self._ctx(w, "sum", x, nonblocking=True), out_f, E) if self.size > 1 else iter(())
            return self._staged(w, _then_return(steps, out), tagged=ring)
        sync_stream(x)
        # receive spec without a count: mpi4py divides the buffer by size (count per rank)
        return self._staged(w, self._lib_steps(lambda: self._coll.Iallgather(wire(src_f), wire(out_f)), out))

    def ibroadcast(self, x, root=0, algo="auto"):
        """Start broadcast(x, root) (in place): wait() returns x."""
        algo = self._i_algo("ibroadcast", algo)
        x = self._broadcast_operands(x, None, True, "ibroadcast")[0]
        w = self._waiter("ibroadcast", x, root=root)
        sync_stream(x)
        return self._staged(w, self._lib_steps(lambda: self._coll.Ibcast(wire(flat(x)), root), x))

    def ialltoall(self, x, out=None, algo="auto"):
        """Start alltoall(x, out=out): wait() returns out."""
        algo = self._i_algo("ialltoall", algo)
        x, out, _, _ = self._alltoall_operands(x, out, False, "ialltoall")
        w = self._waiter("ialltoall", x)
        sync_stream(x)
        return self._staged(w, self._lib_steps(lambda: self._coll.Ialltoall(wire(flat(x)), wire(flat(out))), out))

    def ialltoallv(self, x, send_counts, recv_counts=None, out=None):
        """Start alltoallv: wait() returns (out, recv_counts). Without recv_counts the counts are
        exchanged first (a nonblocking alltoall of int64), then the rows: two stages."""
        x, sc, per_row = self._v_operands(x, send_counts, "ialltoallv", out)
        w = self._waiter("ialltoallv", x, count=per_row)
        sync_stream(x)

        def steps():
            if recv_counts is None:
                rc = np.empty(self.size, dtype=np.int64)
                yield [self._coll.Ialltoall([sc, MPI.INT64_T], [rc, MPI.INT64_T])], [None]
            else:
                rc = np.asarray(backend.to_numpy(recv_counts), dtype=np.int64).reshape(-1)
            res, start = self._v_exchange(x, sc, rc, per_row, out, "ialltoallv")
            yield [start()], [None]
            return res, rc
        return self._staged(w, steps())

    def ibarrier(self):
        w = self._waiter("ibarrier")
        return self._staged(w, self._lib_steps(self._coll.Ibarrier, None))

    # --- point to point -----------------------------------------------------------------
    def _p2p_waiter(self, op):
        self.p2p_seq += 1
        return Waiter(op, self.name, self.p2p_seq, self.timeout)

    def _lazy_waiter(self, op):
        """make() -> the Waiter of a point-to-point operation started now, built on first use
        (its deadline from now: the start's time is read here, the object made only if needed)."""
        self.p2p_seq += 1
        seq, t0, made = self.p2p_seq, time.monotonic(), []

        def make():
            if not made:
                w = Waiter(op, self.name, seq, self.timeout)
                w.deadline = t0 + self.timeout if math.isfinite(self.timeout) else math.inf
                made.append(w)
            return made[0]
        return make

    # blocking send/recv of a C-contiguous NumPy array: the library's nonblocking call polled
    # in place (no Request, no Waiter unless the wait is not short; same deadline and report)
    def send(self, x, dest, tag=0):
        if _lean(x):
            self._poll_p2p(self._p2p.Isend(wire(x), dest, tag), dest, "send")
            return
        self.isend(x, dest, tag).wait()

    def recv(self, buf, source, tag=0):
        if _lean(buf):
            self._poll_p2p(self._p2p.Irecv(wire(buf), source, tag), source, "recv")
            return buf
        return self.irecv(buf, source, tag).wait()

    def _poll_p2p(self, req, peer, op):
        self.p2p_seq += 1
        if not req.Test():
            seq = self.p2p_seq
            poll1(req, lambda: Waiter(op, self.name, seq, self.timeout), peer)

    def isend(self, x, dest, tag=0):
        if _lean(x):                     # NumPy: the lean request
            return P2PRequest(self._p2p.Isend(wire(x), dest, tag), dest, self._lazy_waiter("send"), x)
        self._passable("isend", x)
        x = contiguous(x, "send operand")
        sync_stream(x)
        return Request([self._p2p.Isend(wire(flat(x)), dest, tag)], [dest], self._p2p_waiter("send"), None, x)

    def irecv(self, buf, source, tag=0):
        """Receive into buf (arrays never travel pickled: the receiver supplies the buffer)."""
        if _lean(buf):
            return P2PRequest(self._p2p.Irecv(wire(buf), source, tag), source, self._lazy_waiter("recv"), buf)
        self._passable("irecv", buf)
        buf = contiguous(buf, "recv buffer")
        return Request([self._p2p.Irecv(wire(flat(buf)), source, tag)], [source], self._p2p_waiter("recv"), None, buf)

    def progress(self) -> None:
        """Drive the library's progress engine once (a probe that takes nothing): transfers this
        process started, e.g. large nonblocking sends, move while it waits on something else."""
        self._p2p.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def split(self, color, key=None, name=None):
        """Ranks with equal color form a new MPIComm (None for color=None)."""
        c = self._p2p.Split(MPI.UNDEFINED if color is None else int(color), self.rank if key is None else int(key))
        if c == MPI.COMM_NULL:
            return None
        return MPIComm(c, name=name or f"{self.name}/{color}", timeout=self.timeout, _owned=True, _tuning=self._setting,
                       on_timeout=self.on_timeout)

    def free(self):
        """Release the duplicated communicators and the shared window (collective)."""
        if self._arena is not None:
            self._arena.free()
        if self._topo is not None:          # its node and leaders communicators (not freed: a leak
            self._topo.free()               # that ran a long job out of context ids)
            self._topo = None
        for side in (self._board, self._fp):
            if side is not None:
                side.free()
        for c in (self._coll, self._p2p):
            if c != MPI.COMM_NULL and c not in (MPI.COMM_WORLD, MPI.COMM_SELF):
                c.Free()


def _lean(a) -> bool:
    """Whether a point-to-point operand takes the lean path: a C-contiguous NumPy array with at
    least one dimension, of a dtype pympar.comm takes (checked here; raises otherwise)."""
    if type(a) is _ndarray and a.flags.c_contiguous and a.ndim:
        check_dtype(a.dtype)
        return True
    return False


def _then_return(steps, result):
    """A staged operation's steps, then ``result``."""
    yield from steps
    return result


# each verb's runner of pympar's own algorithms (plans.Plan.own)
_OPERANDS = {"allreduce": MPIComm._allreduce_operands, "reduce_scatter": MPIComm._reduce_scatter_operands,
             "allgather": MPIComm._allgather_operands, "broadcast": MPIComm._broadcast_operands,
             "alltoall": MPIComm._alltoall_operands}
_OWN = {"allreduce": MPIComm._allreduce_own, "reduce_scatter": MPIComm._reduce_scatter_own,
        "allgather": MPIComm._allgather_own, "broadcast": MPIComm._broadcast_own,
        "alltoall": MPIComm._alltoall_own}


_world = None


def world() -> MPIComm:
    """MPIComm over MPI.COMM_WORLD (one per process)."""
    global _world
    if _world is None:
        _world = MPIComm(MPI.COMM_WORLD, name="world")
    return _world
