"""Hierarchical allreduce: shared memory inside each node, a ring across node leaders.

1. inside the node, every rank reduces its slice from the shared window and node rank 0
   (the leader) gathers the node's sum;
2. the leaders allreduce across nodes (ring for large messages, recursive doubling small);
3. the leader's result is broadcast through the window to its node.
"""
from __future__ import annotations

import numpy as np

from ... import kernels
from ..dtypes import finish_avg, reduce_op
from .doubling import recursive_doubling_allreduce
from .p2p import bounds
from .ring import ring_allreduce
from .shm import shm_broadcast

SMALL_BYTES = 64 << 10


def _reduce_to_leader(arena, waiter, src, dst, red):
    n, r, count = arena.size, arena.rank, src.size
    par = arena.ensure(src.nbytes, waiter)
    mine = arena.region(r, par, src.dtype, count)
    np.copyto(mine, src)
    arena.barrier(waiter)
    E = bounds(count, n)
    acc = mine[E[r]:E[r + 1]]
    for j in range(1, n):
        kernels.reduce_inplace(acc, arena.region((r + j) % n, par, src.dtype, count)[E[r]:E[r + 1]], red)
    arena.barrier(waiter)
    if r == 0:
        for k in range(n):
            np.copyto(dst[E[k]:E[k + 1]], arena.region(k, par, src.dtype, count)[E[k]:E[k + 1]])


def hierarchical_allreduce(arena, leaders_ctx, waiter, src, dst, op, world_size):
    """dst (count,) = op over all ranks of src (count,); leaders_ctx is None off the leaders."""
    red = reduce_op(op)
    _reduce_to_leader(arena, waiter, src, dst, red)
    if leaders_ctx is not None and leaders_ctx.size > 1:
        if dst.nbytes <= SMALL_BYTES:
            recursive_doubling_allreduce(leaders_ctx, dst)
        else:
            ring_allreduce(leaders_ctx, dst)
    shm_broadcast(arena, waiter, dst, 0)
    if op == "avg":
        finish_avg(dst, world_size)
