"""Hierarchical collectives: shared memory inside each node, a ring across node leaders.

allreduce:
1. inside the node, every rank reduces its slice from the shared window and node rank 0
   (the leader) gathers the node's sum;
2. the leaders allreduce across nodes (ring for large messages, recursive doubling small);
3. the leader's result is broadcast through the window to its node.
reduce_scatter: step 1, then the leaders reduce-scatter (ring) a copy laid out node by node
(node j's region = the blocks of node j's ranks), and each leader hands its node's ranks their
blocks through the window. allgather: each node's blocks gathered to its leader through the
window, a ring allgather of the node regions across leaders, then every rank reads the whole
result from its leader's window and puts the blocks back in rank order.
Nodes may be uneven and their ranks need not be contiguous in the communicator.
"""
from __future__ import annotations

import numpy as np

from ... import kernels
from ..dtypes import finish_avg, reduce_op
from .doubling import recursive_doubling_allreduce
from .p2p import bounds
from .ring import ring_allgather, ring_allreduce, ring_reduce_scatter
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


def _node_layout(topo, E):
    """Per rank k of the communicator, its block's offset in the node-by-node layout, and the
    bounds of each node's region in that layout."""
    off, NB = {}, [0]
    for members in topo.node_members:
        for k in members:
            off[k] = NB[-1] + sum(E[j + 1] - E[j] for j in members if j < k)
        NB.append(NB[-1] + sum(E[k + 1] - E[k] for k in members))
    return off, NB


def hierarchical_reduce_scatter(arena, topo, leaders_ctx, waiter, src, out, E, op, world_size):
    """out (E[r+1]-E[r],) = op over all ranks of src[E[r]:E[r+1]] (r: rank in the communicator)."""
    red = reduce_op(op)
    node_sum = np.empty_like(src) if arena.rank == 0 else None          # (count,) on the leader
    _reduce_to_leader(arena, waiter, src, node_sum, red)
    off, NB = _node_layout(topo, E)
    mine = topo.node_of[topo.node_to_comm[0]]
    members = topo.node_members[mine]
    region = NB[mine + 1] - NB[mine]
    par = arena.ensure(region * src.itemsize, waiter)
    if arena.rank == 0:
        work = np.empty_like(src)                                          # node-by-node layout
        for k in range(world_size):
            work[off[k]:off[k] + E[k + 1] - E[k]] = node_sum[E[k]:E[k + 1]]
        if leaders_ctx is not None and leaders_ctx.size > 1:
            ring_reduce_scatter(leaders_ctx, work, NB)
        np.copyto(arena.region(0, par, src.dtype, region), work[NB[mine]:NB[mine + 1]])
    arena.barrier(waiter)
    me = members[arena.rank]
    lo = off[me] - NB[mine]
    np.copyto(out, arena.region(0, par, src.dtype, region)[lo:lo + E[me + 1] - E[me]])
    if op == "avg":
        finish_avg(out, world_size)


def hierarchical_allgather(arena, topo, leaders_ctx, waiter, src, out, world_size):
    """out (size*m,) = concatenation over the communicator's ranks of src (m,)."""
    m = src.size
    E = [k * m for k in range(world_size + 1)]
    off, NB = _node_layout(topo, E)
    mine = topo.node_of[topo.node_to_comm[0]]
    members = topo.node_members[mine]
    par = arena.ensure(out.nbytes, waiter)
    np.copyto(arena.region(arena.rank, par, src.dtype, m), src)
    arena.barrier(waiter)
    if arena.rank == 0:
        work = arena.region(0, par, src.dtype, out.size)                  # node-by-node layout
        for i, k in reversed(list(enumerate(members))):                   # own slot 0 read last
            work[NB[mine] + i * m:NB[mine] + (i + 1) * m] = arena.region(i, par, src.dtype, m)
        if leaders_ctx is not None and leaders_ctx.size > 1:
            ring_allgather(leaders_ctx, work, NB)
    arena.barrier(waiter)
    full = arena.region(0, par, src.dtype, out.size)
    for k in range(world_size):
        np.copyto(out[k * m:(k + 1) * m], full[off[k]:off[k] + m])
