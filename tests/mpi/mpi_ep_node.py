"""Node-aware expert dispatch (comm/algorithms/node_a2a.py, parallel/ep.py dispatch="node") on a
simulated multi-node topology (PYMPAR_RANKS_PER_NODE, run by tests/test_ep.py at 4 and 6 ranks, on
shared memory and on the network transport):

- the route against what a flat exchange delivers, with row contents that name their token: every
  destination receives exactly one row per (source, token) it has assignments of, with the columns
  of each assignment; combine sums every assignment's value into its token; reverse hands each
  assignment's value back to its source; empty sources, tokens without assignments, every top-k;
- tokens cross to a node once: the rows this rank sends to other nodes are the distinct (token,
  remote node) pairs, never more than the flat exchange's remote assignments;
- the MoE model with expert parallelism dispatched node-aware trains to the single-process run
  (float64: gradients rel 1e-10, parameters rel 1e-6, as tests/mpi/mpi_ep.py)."""
import os

import numpy as np
import pytest

from mpi_ep import ROUTING, _assert_tensors, _cfg, run_ep, run_single
from pympar.comm.algorithms.node_a2a import NodeRoute
from pympar.parallel.ep import node_route


@pytest.fixture(scope="module")
def world(mpi_world):
    from pympar.comm import MPIComm

    return MPIComm(mpi_world)


@pytest.fixture(scope="module")
def route(world):
    r = NodeRoute.build(world)
    # (nodes of 1 under MPIR_CVAR_NOLOCAL=1: no rank shares memory then)
    assert r is not None and r.n_nodes > 1, "the test runs on a simulated multi-node topology"
    yield r
    r.free()


def _assignments(rank, size, n_tokens, k, seed):
    """k distinct destinations per token (k <= size), some tokens with none (as dropped tokens)."""
    rng = np.random.default_rng([seed, rank])
    tok, dest = [], []
    for t in range(n_tokens):
        if rng.random() < 0.2:
            continue
        for d in rng.choice(size, size=min(k, size), replace=False):
            tok.append(t)
            dest.append(int(d))
    return np.array(tok, np.int64), np.array(dest, np.int64)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("n_tokens", [0, 1, 9])
def test_route_delivers_combines_and_reverses_like_a_flat_exchange(world, mpi_world, route, k, n_tokens):
    me, P = world.rank, world.size
    tok, dest = _assignments(me, P, n_tokens if me % 3 else max(n_tokens - 1, 0), k, 11 * k + n_tokens)
    A = len(tok)
    meta = np.stack([np.arange(A), dest], axis=1)             # the source's assignment id, its destination
    plan = route.plan(tok, dest, meta)
    x = np.stack([np.full(n_tokens, me), np.arange(n_tokens), np.zeros(n_tokens)], axis=1).astype(np.float64)
    xr = plan.dispatch(x)                                     # (rows, 3): (source, token, 0)
    # what each destination must get: every (source, token, assignment) aimed at it, from an allgather
    every = mpi_world.allgather((tok, dest))
    want = sorted((s, int(t), a) for s, (ts, ds) in enumerate(every) for a, (t, d) in enumerate(zip(ts, ds)) if d == me)
    got = sorted((int(xr[r, 0]), int(xr[r, 1]), int(m[0])) for r, m in zip(plan.arow, plan.meta))
    assert got == want
    assert all(int(m[1]) == me for m in plan.meta)           # the columns travelled with their assignment
    pairs = {(int(xr[r, 0]), int(xr[r, 1])) for r in plan.arow}
    assert plan.n_rows == len(pairs) == len(xr)              # one row per (source, token), none repeated
    # combine: each destination contributes (rank + 1) * (token + 1) per assignment it holds
    z = np.zeros((plan.n_rows, 2))
    for r in plan.arow:
        z[r, 0] += (me + 1) * (xr[r, 1] + 1)
        z[r, 1] += 1
    y = plan.combine(z, n_tokens)
    ref = np.zeros((n_tokens, 2))
    for t, d in zip(tok, dest):
        ref[t] += [(d + 1) * (t + 1), 1]
    np.testing.assert_array_equal(y, ref)
    # reverse: each destination answers every assignment with (its rank, the assignment's id)
    back = plan.reverse(np.stack([np.full(len(plan.meta), me), plan.meta[:, 0]], axis=1))
    np.testing.assert_array_equal(back, np.stack([dest, np.arange(A)], axis=1).reshape(A, 2))


def test_tokens_cross_to_a_node_once(world, route):
    me, P = world.rank, world.size
    tok, dest = _assignments(me, P, 64, 4, 5)
    before = route.rows_across
    route.plan(tok, dest, np.zeros((len(tok), 1), np.int64))
    sent = route.rows_across - before
    mine = route.node_of[me]
    remote = route.node_of[dest] != mine
    assert sent == len({(int(t), int(route.node_of[d])) for t, d in zip(tok[remote], dest[remote])})
    if route.node.size > 1:
        assert sent < remote.sum()                           # top-4 over nodes of 2: repeats were saved


def test_auto_takes_the_route_across_nodes_only(world):
    assert node_route(world, "flat") is None
    assert node_route(world, "auto", top_k=1) is None
    r = node_route(world, "auto", top_k=2)
    assert r is not None
    r.free()


@pytest.mark.parametrize("routing", list(ROUTING))
def test_node_dispatch_trains_like_single_process(world, routing):
    cfg = _cfg(routing, n_expert=world.size)
    n_micro, steps = 2, 3
    ref = run_single(cfg, n_micro * world.size, steps)
    ep = world.size                                           # the ep group spans the nodes
    got = run_ep(world, cfg, ep, n_micro, steps, dispatch="node")
    assert got["model"].ep_route is not None
    layout = f"dp={world.size} ep={ep} node-aware {routing}"
    _assert_tensors(got["grads"], ref["grads"], 1e-10, "gradient (step 0, after sync)", layout, got["shards"])
    np.testing.assert_allclose(got["losses"][0], ref["losses"][0], rtol=1e-12, err_msg=layout)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6, err_msg=layout)
    _assert_tensors(got["params"], ref["params"], 1e-6, f"parameter after {steps} AdamW steps", layout, got["shards"])


def test_node_dispatch_with_tensor_parallel_experts(world):
    """tp = 2 (adjacent ranks, so each tp pair shares a node and the ep group of the two dp ranks
    spans two nodes): the tp ranks plan identical routes and their experts' partial products are
    summed over tp inside the experts; the single-process run again."""
    if world.size != 4 or os.environ.get("MPIR_CVAR_NUM_CLIQUES"):
        pytest.skip("tp = 2 with each tp pair on one of 2 nodes: 4 ranks, nodes of consecutive ranks "
                    "(MPICH's cliques deal ranks round-robin)")
    cfg = _cfg("dropless")
    ref = run_single(cfg, 2 * 2, 2)
    got = run_ep(world, cfg, 2, 2, 2, tp=2, sp=True, dispatch="node")
    assert got["model"].ep_route is not None                  # the ep group spans the two nodes
    layout = "dp=2 tp=2 sp ep=2 node-aware"
    _assert_tensors(got["grads"], ref["grads"], 1e-10, "gradient (step 0, after sync)", layout, got["shards"])
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6, err_msg=layout)
