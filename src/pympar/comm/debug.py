"""Debug mode for collectives: ``PYMPAR_DEBUG_COLLECTIVES=1``.

Before each collective of an MPIComm, its ranks exchange a fingerprint of the call -- the
operation, the element count (or the row size where counts may differ, as in alltoallv),
the dtype, the root, the sequence number and the caller's ``file:line`` -- on a shadow
communicator, and compare them. The first difference raises
:class:`CollectiveMismatchError` on every rank with both call sites, instead of a hang, a
wrong answer or a crash inside MPI. The exchange is a library allgather under the same
deadline as the collective itself (a rank that never calls anything still times out).

Off (the default), an MPIComm holds no checker and pays one ``is None`` test per call.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from .settings import SETTINGS
from .watchdog import op_code

SITE_BYTES = 200          # "op file:line", truncated
_FIELDS = 5               # op code, count, dtype code, root, seq
_COMM_DIR = os.path.dirname(os.path.abspath(__file__))


def enabled() -> bool:
    return SETTINGS.debug_collectives


class CollectiveMismatchError(RuntimeError):
    """Ranks of one communicator called different collectives (or the same with other sizes)."""

    def __init__(self, comm_name, seq, rank_a, fp_a, rank_b, fp_b):
        self.comm_name, self.seq, self.ranks = comm_name, seq, (rank_a, rank_b)
        super().__init__(
            f"collective #{seq} on communicator {comm_name!r} does not match across ranks: "
            f"rank {rank_a} called {_describe(fp_a)}, rank {rank_b} called {_describe(fp_b)}")


def _describe(fp):
    op, count, dtype, root, site = fp
    r = f", root {root}" if root >= 0 else ""
    return f"{op}(count {count}, dtype {dtype}{r}) at {site}"


def call_site() -> str:
    """file:line of the innermost caller outside pympar/comm."""
    f = sys._getframe(1)
    while f is not None and os.path.dirname(os.path.abspath(f.f_code.co_filename)) .startswith(_COMM_DIR):
        f = f.f_back
    if f is None:
        return "?"
    return f"{f.f_code.co_filename}:{f.f_lineno}"


class FingerprintChecker:
    """Compares every collective's fingerprint across the ranks of ``mpi_comm`` (collective to build)."""

    def __init__(self, mpi_comm, name):
        self.comm = mpi_comm.Dup()
        self.name = name
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def check(self, op, seq, count, dtype, root, waiter):
        """Exchange and compare; raises CollectiveMismatchError (or CommTimeoutError via waiter)."""
        from .progress import Waiter

        dname = str(np.dtype(dtype)) if dtype is not None else "-"
        site = f"{op}|{dname}|{call_site()}".encode()[:SITE_BYTES]
        rec = np.zeros(_FIELDS * 8 + SITE_BYTES, np.uint8)
        rec[:_FIELDS * 8].view(np.int64)[:] = [op_code(op), count, op_code(dname), root, seq]
        rec[_FIELDS * 8:_FIELDS * 8 + len(site)] = np.frombuffer(site, np.uint8)
        allrec = np.empty((self.size, rec.size), np.uint8)
        w = Waiter(f"{op} (debug fingerprint)", self.name, seq, waiter.timeout, waiter.board)
        w.deadline = waiter.deadline
        w.wait([self.comm.Iallgather(rec, allrec)], [None])
        head = allrec[:, :_FIELDS * 8].copy().view(np.int64)     # (size, 5)
        for r in range(1, self.size):
            if (head[r] != head[0]).any():
                raise CollectiveMismatchError(self.name, seq, 0, _decode(allrec[0]), r, _decode(allrec[r]))

    def free(self):
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def _decode(rec):
    h = rec[:_FIELDS * 8].copy().view(np.int64)
    text = rec[_FIELDS * 8:].tobytes().rstrip(b"\0").decode(errors="replace")
    op, dname, site = (text.split("|", 2) + ["?", "?"])[:3]
    return op, int(h[1]), dname, int(h[3]), site
