"""Node-aware all-to-all for token dispatch: each token crosses to a node once, then fans out inside it.

A flat alltoallv sends one row per (token, destination rank): with top-k routing a token whose k
destinations share a remote node crosses the network up to k times. Here (DeepEP's idea, on MPI)
the exchange runs in two hops over two communicators split from the group:

    rail  the ranks with the same local index on every node (one per node): between nodes
    node  the ranks of one node: shared memory

Dispatch: a source sends each token ONCE to each destination node, to its rail peer there (itself
for its own node); that gateway forwards the token once to each rank of its node that needs it.
Combine (the reverse): each destination sums its rows for a token into one, the gateway sums its
node's rows for the token into one and sends one row back across the network, and the source adds
one row per node. Assignment-level values (which local expert, the gate; on the way back, a
gradient per assignment) travel beside the rows as int64 columns.

Rows leave and arrive in a fixed order (destination node or rank, then source token order), and
every sum is the scatter-add kernel (kernels.unpermute_add) in that order, so a route gives the
same bits on every run; against the flat exchange the sums are grouped differently (per node
first), equal within the floating-point tolerance of k terms.

Nodes must hold equally many ranks of the group (the rail pairs rank i of every node);
``NodeRoute.build`` returns None otherwise, and when the group is on one node (then the flat
exchange is the route).
"""
from __future__ import annotations

import numpy as np

from ... import kernels


def _exclusive(counts):
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # host


def _group_unique(keys):
    """keys (n, 2) int64 sorted lexicographically -> (first index of each distinct key, its run id per row)."""
    if len(keys) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)  # host
    new = np.ones(len(keys), bool)  # host
    new[1:] = np.any(keys[1:] != keys[:-1], axis=1)
    return np.flatnonzero(new), np.cumsum(new) - 1


def _blocking(blocking, start):
    """NodeRoute's default exchange: the blocking call."""
    return blocking()


class NodeRoute:
    """The two communicators of a group's node-aware exchange and where each group rank lives."""

    def __init__(self, group, node, rail, node_of, local_of):
        self.group, self.node, self.rail = group, node, rail
        self.node_of = np.asarray(node_of, np.int64)    # host: node index of every group rank
        self.local_of = np.asarray(local_of, np.int64)  # host: its index inside its node
        self.n_nodes = int(self.node_of.max()) + 1
        self.rows_across = 0                             # token rows this rank sent to other nodes
        # exchange(blocking, start) -> blocking()'s result: what runs each of the route's exchanges
        # (by default the blocking call). The pipeline's interleaved pairs set one that starts the
        # exchange nonblocking and hands over to the partner strand until it waits (parallel/overlap.py)
        self.exchange = _blocking

    @classmethod
    def build(cls, group):
        """Collective over ``group`` (an MPIComm): the route, or None when the group is on one node or
        its nodes are uneven (every rank answers the same)."""
        if group.size == 1 or not callable(getattr(group, "topology", None)):
            return None
        topo = group.topology()
        node_of = list(topo.node_of)
        members = topo.node_members
        if len(members) == 1 or len({len(m) for m in members}) != 1:
            return None
        local_of = [0] * group.size
        for m in members:
            for i, r in enumerate(m):
                local_of[r] = i
        me = group.rank
        node = group.split(node_of[me], key=local_of[me], name=f"{group.name}/node")
        rail = group.split(local_of[me], key=node_of[me], name=f"{group.name}/rail")
        return cls(group, node, rail, node_of, local_of)

    def free(self):
        for c in (self.node, self.rail):
            c.free()

    def alltoallv(self, comm, x, send, recv):
        """comm.alltoallv(x, send, recv)'s rows (comm: the route's node or rail communicator), run
        through ``exchange``."""
        return self.exchange(lambda: comm.alltoallv(x, send, recv), lambda: comm.ialltoallv(x, send, recv))[0]

    def alltoall(self, comm, x):
        return self.exchange(lambda: comm.alltoall(x), lambda: comm.ialltoall(x))

    def plan(self, token, dest, meta):
        """A collective exchange plan (counts and assignment columns travel now). Per assignment of
        this source: its token (row of the x given to dispatch), its destination group rank and
        ``meta`` (A, w) int64 columns for the destination (w the same on every rank). Returns a Plan."""
        meta = np.ascontiguousarray(meta, np.int64)  # host
        if meta.ndim != 2 or meta.shape[0] != len(token):
            raise ValueError(f"NodeRoute.plan: meta must be (assignments, columns), got {meta.shape} for {len(token)}")
        return Plan(self, np.asarray(token, np.int64), np.asarray(dest, np.int64), meta)  # host


def _swap(route, comm, counts_rows, counts_meta):
    """alltoall of each peer's (rows, assignments) counts -> what each peer sends here."""
    got = route.alltoall(comm, np.stack([counts_rows, counts_meta], axis=1).astype(np.int64).copy())  # host
    got = np.asarray(got).reshape(comm.size, 2)
    return got[:, 0].copy(), got[:, 1].copy()


class Plan:
    """One dispatch/combine pattern (a MoE layer's micro-batch): see the module docstring.

    At the destination after construction: ``arow`` (A2,) the received row of each arriving
    assignment, ``meta`` (A2, w) its columns, ``n_rows`` the rows ``dispatch`` delivers."""

    def __init__(self, route, token, dest, meta):
        self.route = r = route
        node_of, local_of = r.node_of, r.local_of
        n_a = node_of[dest]
        l_a = local_of[dest]
        # hop 1 (rail, between nodes): assignments by (node, token); one row per distinct pair
        o1 = np.lexsort((np.arange(len(token)), l_a, token, n_a))
        self.o1 = o1
        first, run = _group_unique(np.stack([n_a[o1], token[o1]], axis=1))
        self.tok1 = token[o1][first]                                 # tokens sent, node-major
        nodes1 = n_a[o1][first]
        self.c1 = np.bincount(nodes1, minlength=r.n_nodes).astype(np.int64)       # rows to each node
        m1 = np.bincount(n_a, minlength=r.n_nodes).astype(np.int64)               # assignments to each node
        self.m1 = m1
        u_in_block = run - _exclusive(self.c1)[n_a[o1]]
        send_meta = np.concatenate([u_in_block[:, None], l_a[o1][:, None], meta[o1]], axis=1)
        self.rc1, self.rm1 = _swap(r, r.rail, self.c1, m1)
        me_node = node_of[r.group.rank]
        r.rows_across += int(self.c1.sum() - self.c1[me_node])
        got1 = r.alltoallv(r.rail, np.ascontiguousarray(send_meta), m1, self.rm1)
        got1 = np.asarray(got1).reshape(-1, send_meta.shape[1])
        # at the gateway: row of each arriving assignment in the hop-1 rows (block offset + its u)
        src_block = np.repeat(np.arange(r.rail.size), self.rm1)
        row1 = _exclusive(self.rc1)[src_block] + got1[:, 0]
        l_e = got1[:, 1]
        # hop 2 (node, shared memory): entries by (local rank, hop-1 row); one row per distinct pair
        o2 = np.lexsort((np.arange(len(row1)), row1, l_e))
        self.o2 = o2
        first2, run2 = _group_unique(np.stack([l_e[o2], row1[o2]], axis=1))
        self.row2 = row1[o2][first2]                                 # hop-1 rows forwarded, rank-major
        ranks2 = l_e[o2][first2]
        self.c2 = np.bincount(ranks2, minlength=r.node.size).astype(np.int64)
        self.m2 = np.bincount(l_e, minlength=r.node.size).astype(np.int64)
        u2 = run2 - _exclusive(self.c2)[l_e[o2]]
        send2 = np.concatenate([u2[:, None], got1[o2, 2:]], axis=1)
        self.rc2, self.rm2 = _swap(r, r.node, self.c2, self.m2)
        got2 = r.alltoallv(r.node, np.ascontiguousarray(send2), self.m2, self.rm2)
        got2 = np.asarray(got2).reshape(-1, send2.shape[1])
        blk = np.repeat(np.arange(r.node.size), self.rm2)
        self.arow = _exclusive(self.rc2)[blk] + got2[:, 0]
        self.meta = got2[:, 1:]
        self.n_rows = int(self.rc2.sum())
        self.n_rows1 = int(self.rc1.sum())

    def dispatch(self, x):
        """x (N, C): token rows at the source -> (n_rows, C) at the destination (one per token and rank)."""
        r = self.route
        h1 = r.alltoallv(r.rail, kernels.permute(x, self.tok1), self.c1, self.rc1)
        if r.node.size == 1:                     # nodes of one rank: hop 2 hands every row to itself, in order
            return h1
        h2 = r.alltoallv(r.node, kernels.permute(h1, self.row2), self.c2, self.rc2)
        return h2

    def combine(self, z, n_tokens):
        """z (n_rows, C) at the destination (one row per received row) -> (n_tokens, C) at the source:
        every row summed into its token, per node at the gateway first."""
        r = self.route
        if r.node.size == 1:                     # (row2 is every hop-1 row once, in order)
            s1 = z
        else:
            back2 = r.alltoallv(r.node, z, self.rc2, self.c2)               # in the hop-2 send order
            s1 = kernels.unpermute_add(back2, self.row2, None, self.n_rows1)   # one row per hop-1 row
        back1 = r.alltoallv(r.rail, s1, self.rc1, self.c1)                  # in the hop-1 send order
        return kernels.unpermute_add(back1, self.tok1, None, n_tokens)

    def reverse(self, v):
        """v (A2, w) int64 per arriving assignment (w the same on every rank) -> (A, w) at the source,
        in its assignments' order."""
        r = self.route
        v = np.ascontiguousarray(v, np.int64)  # host
        if v.ndim != 2 or v.shape[0] != len(self.arow):
            raise ValueError(f"Plan.reverse: v must be (arriving assignments, columns), got {v.shape}")
        b2 = r.alltoallv(r.node, v, self.rm2, self.m2)
        v1 = np.empty_like(b2)
        v1[self.o2] = b2
        b1 = r.alltoallv(r.rail, v1, self.rm1, self.m1)
        out = np.empty_like(b1)
        out[self.o1] = b1
        return out
