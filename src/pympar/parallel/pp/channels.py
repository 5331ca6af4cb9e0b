"""Ordered channels: the pipeline's messages without tags, as NCCL needs them.

The executor names each message by a tag and posts receives ahead, so over MPI any order of
arrival lands in the right buffer. NCCL has no tags: a send and a receive between two ranks of
one communicator match in issue order, and every operation of a communicator runs in issue
order on its stream, so a receive posted ahead would hold up the sends queued behind it.

A channel is a two-rank communicator that carries one kind of message in one direction:

    (r -> r+1, "F")   activations to the next stage      (r+1 -> r, "B")   gradients back
    (p-1 -> 0, "F")   and (0 -> p-1, "B"): the wrap-around of interleaved schedules (v > 1)
    (r+1 -> r, "F")   and (r -> r+1, "B"): the second arm of ZB-V's V (placement "v"), whose
                      turn (stage p-1 -> p on rank p-1) is a message to the rank itself: a
                      local first-in first-out queue per kind, no communicator

plus one pair (0, p-1) for the tied embedding gradient (a grouped send/receive). On a channel
one rank only sends and the other only receives, so its single stream can never block the
other direction; and for every schedule the sender issues its sends in the order the receiver
consumes them (checked for all schedules in tests/test_pp.py::test_channels_carry_messages_in_
consumption_order), so the n-th send meets the n-th receive. Over MPI the same channels work
with one tag (MPI never lets two messages of one sender, tag and communicator overtake each
other), which is how the CPU tests prove the ordering: PYMPAR_PP_CHANNELS=1.

Used by default when the pipeline communicator is a DeviceComm with NCCL (pympar.comm.hybrid);
``--pp-channels tags`` (PYMPAR_PP_CHANNELS=0) sends over the MPI side with tags instead, ``ordered``
(=1) forces channels on MPI too.
"""
from __future__ import annotations


def wanted(comm, mode: bool | None = None) -> bool:
    """Whether the executor uses ordered channels on ``comm``: ``mode`` True or False when the run
    says so (``--pp-channels ordered|tags``), else (None) exactly when the pipeline runs on NCCL."""
    if mode is not None:
        return bool(mode)
    return bool(getattr(comm, "uses_nccl", False))


def channel_edges(p: int, v: int, placement: str = "interleaved"):
    """The (sender, receiver, kind) channels of a p-rank pipeline with v chunks per rank placed
    ``placement``, in the order every rank creates them (a message of a rank to itself, the V's
    turn, needs none)."""
    if p < 2:
        return []
    out = []
    if placement == "v":                     # both arms: up the ranks (chunk 0), down (chunk 1)
        for kind in ("F", "B"):
            for a in range(p - 1):
                out += [(a, a + 1, kind), (a + 1, a, kind)]
        return out
    for kind in ("F", "B"):
        for a in range(p):
            dst = (a + 1) % p if kind == "F" else (a - 1) % p
            wraps = (kind == "F" and dst == 0) or (kind == "B" and a == 0)
            if wraps and v == 1:
                continue
            out.append((a, dst, kind))
    return out


class _Local:
    """A rank's messages to itself on one kind: sends queue their buffer; a receive, posted ahead
    like every receive, takes the oldest when it is waited for (the schedule sends before it
    consumes, in the same order: tests/test_pp.py checks it)."""

    def __init__(self):
        self.queue = []

    def isend(self, buf):
        self.queue.append(buf)
        return _Done()

    def irecv(self, buf):
        return _LocalRecv(self, buf)


class _Done:
    def wait(self):
        return None

    def test(self):
        return True


class _LocalRecv:
    __slots__ = ("q", "buf")

    def __init__(self, q, buf):
        self.q, self.buf = q, buf

    def test(self):
        return bool(self.q.queue)

    def wait(self):
        if not self.q.queue:
            raise RuntimeError("pipeline channels: a rank waits for a message to itself that it has not sent "
                               "(the schedule consumes before it produces)")
        self.buf[...] = self.q.queue.pop(0)
        return self.buf


class Channels:
    """This rank's channels over ``comm`` (a pympar Communicator of the pipeline's p ranks).
    Collective: every rank of comm constructs it at the same point."""

    def __init__(self, comm, v: int, placement: str = "interleaved"):
        self.rank, p = comm.rank, comm.size
        self._ch = {}
        self._self = {"F": _Local(), "B": _Local()}
        for src, dst, kind in channel_edges(p, v, placement):
            member = self.rank in (src, dst)
            sub = comm.split(0 if member else None, key=self.rank, name=f"{comm.name}:{kind}{src}>{dst}")
            if member:
                self._ch[(src, dst, kind)] = sub
        self.tied = None
        if p >= 2:
            member = self.rank in (0, p - 1)
            sub = comm.split(0 if member else None, key=self.rank, name=f"{comm.name}:tied")
            self.tied = sub if member else None

    @staticmethod
    def _kind(tag: int) -> str:
        return "B" if tag & 1 else "F"         # the executor's tags: ((chunk*m + micro) << 1) | is_backward

    def isend(self, buf, dest, tag):
        if dest == self.rank:
            return self._self[self._kind(tag)].isend(buf)
        ch = self._ch[(self.rank, dest, self._kind(tag))]
        return ch.isend(buf, 1 - ch.rank, tag=0)

    def irecv(self, buf, source, tag):
        if source == self.rank:
            return self._self[self._kind(tag)].irecv(buf)
        ch = self._ch[(source, self.rank, self._kind(tag))]
        return ch.irecv(buf, 1 - ch.rank, tag=0)

    def exchange_tied(self, g, peer):
        """Send g to the other end of the (first, last) stage pair and receive its g into peer."""
        return self.tied.sendrecv(g, 1 - self.tied.rank, peer, 1 - self.tied.rank)

    def free(self):
        for c in list(self._ch.values()) + [self.tied]:
            if c is not None and hasattr(c, "free"):
                c.free()
