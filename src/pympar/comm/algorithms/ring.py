"""Ring reduce-scatter / allgather / allreduce, chunked and pipelined.

Rank r sends to r+1 and receives from r-1. At step s it sends logical block (r - s) and
receives logical block (r - s - 1); steps 0..n-2 reduce what arrives (reduce-scatter),
steps n-1..2n-3 copy it (allgather). Each block travels in segments of SEGMENT_BYTES:
as soon as segment k of step s has arrived and been reduced it is sent on as segment k of
step s+1, and step s+1's receives are posted before step s is worked, so transfer overlaps
reduction. One tag suffices: MPI keeps the order of messages between two ranks.

The ring is written as a generator of stages (``*_steps``: each yields the requests it waits
for), so the same code runs blocking (``drive``) and nonblocking (``progress.StagedRequest``,
moved on by ``test()``; see MPIComm's i-verbs).
"""
from __future__ import annotations

from ..progress import drive
from .p2p import bounds

SEGMENT_BYTES = 1 << 20


def ring_allreduce_steps(ctx, buf):
    """buf (count,) reduced in place over the ring."""
    return _ring(ctx, buf, bounds(buf.size, ctx.size), 0, 2 * ctx.size - 2, 0)


def ring_reduce_scatter_steps(ctx, buf, E):
    """buf (count,) reduced so that block r = buf[E[r]:E[r+1]] holds the result on rank r."""
    return _ring(ctx, buf, E, 0, ctx.size - 1, -1)


def ring_allgather_steps(ctx, buf, E):
    """buf (count,) with block r filled on rank r; afterwards every block everywhere."""
    return _ring(ctx, buf, E, ctx.size - 1, 2 * ctx.size - 2, -1)


def ring_allreduce(ctx, buf):
    drive(ctx.waiter, ring_allreduce_steps(ctx, buf))


def ring_reduce_scatter(ctx, buf, E):
    drive(ctx.waiter, ring_reduce_scatter_steps(ctx, buf, E))


def ring_allgather(ctx, buf, E):
    drive(ctx.waiter, ring_allgather_steps(ctx, buf, E))


def _ring(ctx, buf, E, s0, s1, shift):
    n, r = ctx.size, ctx.rank
    if n == 1 or s0 >= s1:
        return
    left, right = (r - 1) % n, (r + 1) % n
    seg = max(1, SEGMENT_BYTES // max(1, buf.itemsize))

    def blk(logical):
        return (logical + shift) % n

    def segs(b):
        lo, hi = E[b], E[b + 1]
        return [(i, min(i + seg, hi)) for i in range(lo, hi, seg)]

    maxblk = max(E[i + 1] - E[i] for i in range(n))
    tmp = [ctx.empty(maxblk, buf), ctx.empty(maxblk, buf)] if s0 < n - 1 else None
    sends = {}  # step -> its send requests, waited before their buffer is written again

    def post_recvs(t):
        if t >= s1:
            return None
        b = blk(r - t - 1)
        ss = segs(b)
        if t < n - 1:
            dst = [tmp[t % 2][lo - E[b]:hi - E[b]] for lo, hi in ss]
        else:
            dst = [buf[lo:hi] for lo, hi in ss]
        return ss, dst, [ctx.irecv(d, left) for d in dst]

    sends[s0] = [ctx.isend(buf[lo:hi], right) for lo, hi in segs(blk(r - s0))]
    nxt = post_recvs(s0)
    for s in range(s0, s1):
        ss, dst, reqs = nxt
        old = sends.pop(s + 2 - n, None)   # the block received at step s+1 was sent at step s+2-n
        if old:
            yield old, [right] * len(old)
        nxt = post_recvs(s + 1)
        out = []
        for (lo, hi), d, q in zip(ss, dst, reqs):
            yield [q], [left]
            if s < n - 1:
                ctx.reduce(buf[lo:hi], d)
            if s + 1 < s1:
                out.append(ctx.isend(buf[lo:hi], right))
        if s + 1 < s1:
            sends[s + 1] = out
    for t in list(sends):
        reqs = sends.pop(t)
        yield reqs, [right] * len(reqs)
