"""Broadcast over point-to-point: a binomial tree (small) and scatter + ring allgather (large).

binomial: ranks are renumbered relative to the root (v = (r - root) mod n). A rank receives
from v minus its lowest set bit, then sends to v + 2^k for every 2^k below that bit: log2(n)
rounds, the whole message on every edge.
scatter_allgather (van de Geijn): the root sends block k of the buffer to rank k, then a ring
allgather completes every block everywhere: about 2 (n-1)/n of the message crosses each link
instead of log2(n) whole copies, which wins once the message is large.
"""
from __future__ import annotations

from .p2p import bounds
from .ring import ring_allgather


def binomial_broadcast(ctx, buf, root):
    """buf (count,) of rank root copied into buf on every rank of ctx."""
    n = ctx.size
    v = (ctx.rank - root) % n
    mask = 1
    while mask < n:
        if v & mask:
            ctx.recv(buf, (v - mask + root) % n)
            break
        mask <<= 1
    mask >>= 1
    reqs, peers = [], []
    while mask > 0:
        if v + mask < n:
            dst = (v + mask + root) % n
            reqs.append(ctx.isend(buf, dst))
            peers.append(dst)
        mask >>= 1
    ctx.waiter.wait(reqs, peers)


def scatter_allgather_broadcast(ctx, buf, root):
    """buf (count,) of rank root everywhere: linear scatter of the blocks, then ring allgather."""
    n, r = ctx.size, ctx.rank
    E = bounds(buf.size, n)
    if r == root:
        reqs = [ctx.isend(buf[E[k]:E[k + 1]], k) for k in range(n) if k != root]
        ctx.waiter.wait(reqs, [k for k in range(n) if k != root])
    else:
        ctx.recv(buf[E[r]:E[r + 1]], root)
    ring_allgather(ctx, buf, E)
