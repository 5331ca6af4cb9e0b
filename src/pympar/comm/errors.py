"""Errors raised by the communicators."""
from __future__ import annotations


class CommTimeoutError(RuntimeError):
    """A blocking wait inside pympar passed its deadline.

    Carries what a watchdog needs to report: the operation, the communicator's name, the
    per-communicator sequence number of the call and the peer ranks not yet heard from.
    """

    def __init__(self, op: str, comm_name: str, seq: int, pending_peers, timeout: float, detail: str = ""):
        self.op = op
        self.comm_name = comm_name
        self.seq = seq
        self.pending_peers = sorted(set(int(p) for p in pending_peers if p is not None and p >= 0))
        self.timeout = timeout
        peers = ", ".join(map(str, self.pending_peers)) or "unknown (inside the MPI library's collective)"
        msg = (f"{op} #{seq} on communicator {comm_name!r} timed out after {timeout:g}s: "
               f"no answer from rank(s) {peers}")
        if detail:
            msg += f" ({detail})"
        msg += "; a rank skipped this call, called a different operation, or died (set comm.timeout or PYMPAR_COMM_TIMEOUT to change the limit)"
        super().__init__(msg)
