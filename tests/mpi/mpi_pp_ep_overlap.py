"""DualPipeV's F & B pairs interleaved at the expert-parallel all-to-alls (parallel/overlap.py),
under mpiexec: pp = 2 with ep = 2 over the data-parallel ranks, every block a MoE block, so both
strands of a pair exchange.

The same layout trains twice, with the overlap on and off (the same table run one action after
another). It checks:
  * the pairs ran interleaved: the step reports its overlapped pairs, and some all-to-alls started
    inside a pair whose partner was still running (control passed there), on every rank;
  * with the overlap off no pair ran and no all-to-all started inside one;
  * the step counts what it holds in the table's order: peak micro-batches in flight and activation
    bytes equal to the run with the overlap off;
  * losses, gradient norms and every parameter are bitwise those of the run with the overlap off
    (float64 and float32; ZeRO-1 and full recomputation, whose backward runs the forward's
    all-to-alls again inside the pair);
  * the profiler's trace shows the pairs' turns where they ran: an action's events alternate with
    its partner's (the overlap off: one event an action), never two at once, and they add up to
    the step's compute seconds.
Runs at world sizes 4 and 8 (tp 2 with ep 2, and ep 4 folded over dp x tp; other sizes skip).
"""
import os

import numpy as np
import pytest

from layout_cases import G, MOE, Layout
from mpi_layouts import LR, free_mesh, global_batch, opts_of, optim_of
from pympar.backend import to_numpy
from pympar.comm import MPIComm
from pympar.nn import GPTConfig
from pympar.parallel import overlap
from pympar.parallel.recorder import Recorder
from pympar.parallel.runner import ParallelRunner

STEPS = 2
CFG = GPTConfig(**dict(MOE, moe_every=1))            # every block routes: both strands of a pair exchange


@pytest.fixture(scope="module")
def world(mpi_world):
    return MPIComm(mpi_world, name="world", timeout=60)


def layouts(n):
    kw = dict(dp=2, pp=2, ep=2, model="moe", schedule="dualpipev", virtual_stages=2, micro_batch_size=2, n_micro=G // 2)
    if n == 4:
        return [Layout(**kw), Layout(**kw, dtype="float32", zero=1), Layout(**kw, recompute="full")]
    if n == 8:                     # with tp 2: its collectives run inside the strands too
        return [Layout(**kw, tp=2), Layout(**dict(kw, ep=4), tp=2, etp=1)]
    return []


class Exchanges:
    """Counts the all-to-alls that start inside a pair whose partner still runs (where control passes)."""

    def __init__(self, monkeypatch):
        self.inside = self.total = 0
        real = overlap.exchange

        def counted(blocking, start):
            self.total += 1
            self.inside += overlap.active()
            return real(blocking, start)
        monkeypatch.setattr(overlap, "exchange", counted)


def train(world, lay, mode, counter, dispatch="auto"):
    opts = opts_of(lay)
    opts.pp_overlap, opts.ep_dispatch = mode, dispatch
    rec = Recorder(enabled=True)                          # the profiler's events (--profile)
    runner = ParallelRunner(CFG, lay, world, opts, optim_of(lay), rec)
    got = dict(losses=[], norms=[], pairs=[], held=[], layer=[])
    counter.inside = counter.total = 0
    for s in range(STEPS):
        mbs = [mb for k in range(-(-lay.dp * lay.n_micro // G)) for mb in global_batch(s + 100 * k, CFG.vocab_size)]
        mine = mbs[runner.mesh.dp_rank * lay.n_micro:(runner.mesh.dp_rank + 1) * lay.n_micro]
        res = runner.train_step(mine, LR[lay.dtype])
        got["losses"].append(res.loss)
        got["norms"].append(res.grad_norm)
        st = runner.executor.stats
        got["pairs"].append(st["overlapped_pairs"])
        got["held"].append((st["peak_in_flight"], st["activation_peak_bytes"]))
        got["layer"].append(([(name, t0, dur, args["mb"]) for name, cat, t0, dur, args in rec.events if cat == "layer"],
                             st["compute_s"]))
        rec.events.clear()
    got["params"] = {n: to_numpy(p.data).copy() for n, p in runner.named}
    got["inside"], got["total"] = counter.inside, counter.total
    route = getattr(runner.model, "ep_route", None)
    got["route"] = None if route is None else (route.node.size, route.rail.size)
    free_mesh(runner.mesh)
    return got


def test_overlapped_pairs_are_the_sequential_run_bitwise(world, monkeypatch):
    cases = layouts(world.size)
    if not cases:
        pytest.skip(f"world size {world.size}: these layouts run at 4 or 8 ranks")
    compare(world, monkeypatch, cases, "flat")


def test_node_aware_hops_overlap_bitwise(world, monkeypatch):
    """The node-aware route's hops (rail between nodes, then inside the node) are hand-over points
    too. tests/test_pp_ep_overlap.py runs it with every rank its own node (4 ranks: the rail hop
    only) and, @slow, two ranks a node (8 ranks, dp 4 x pp 2 with ep 4 over 2 nodes: both hops; the
    route does not take ep folded over tp)."""
    rpn = int(os.environ.get("PYMPAR_RANKS_PER_NODE", "0"))
    if not rpn or world.size not in (4, 8):
        pytest.skip("needs an ep group over several nodes (PYMPAR_RANKS_PER_NODE), 4 or 8 ranks")
    if world.size == 4:
        lay = layouts(4)[-1]                       # full recomputation: the hops run again inside the pairs
    else:
        lay = Layout(dp=4, pp=2, ep=4, model="moe", schedule="dualpipev", virtual_stages=2, micro_batch_size=2,
                     n_micro=4)
    route = compare(world, monkeypatch, [lay], "node")
    assert route[0] == min(rpn, lay.ep) and route[0] * route[1] == lay.ep, route   # both hops where a node has 2


def compare(world, monkeypatch, cases, dispatch):
    counter = Exchanges(monkeypatch)
    for lay in cases:
        where = f"rank {world.rank} [{lay}, {dispatch}]"
        on = train(world, lay, "on", counter, dispatch)
        off = train(world, lay, "off", counter, dispatch)
        assert (on["route"] is not None) == (dispatch == "node") and on["route"] == off["route"], (where, on["route"])
        route = on["route"]
        assert min(on["pairs"]) > 0 and off["pairs"] == [0] * STEPS, (where, on["pairs"], off["pairs"])
        assert on["total"] == off["total"] > 0, (where, on["total"], off["total"])
        assert on["inside"] > 0 and off["inside"] == 0, \
            f"{where}: {on['inside']} of {on['total']} all-to-alls started inside a live pair (off: {off['inside']})"
        assert on["held"] == off["held"], f"{where}: micro-batches and bytes held {on['held']} vs off {off['held']}"
        assert on["losses"] == off["losses"] and on["norms"] == off["norms"], \
            f"{where}: {on['losses']} {on['norms']} vs overlap off {off['losses']} {off['norms']}"
        for n, a in on["params"].items():
            assert np.array_equal(a, off["params"][n]), f"{where}: {n} differs from the run with the overlap off"
        assert [split(step) for step in off["layer"]] == [0] * STEPS
        assert min(split(step) for step in on["layer"]) > 0, f"{where}: the trace shows no action's turns alternating"
    return route


def split(events):
    """The actions (label, micro-batch) of one step whose trace events are interrupted by another
    action's, after checking that no two events overlap in time and that they add up to the step's
    compute seconds."""
    events, compute = events
    ev = sorted(events, key=lambda e: e[1])
    assert sum(e[2] for e in ev) == pytest.approx(compute, rel=1e-9, abs=1e-12)
    assert all(a[1] + a[2] <= b[1] + 1e-9 for a, b in zip(ev, ev[1:])), "two actions' events overlap in time"
    runs = [k for i, k in enumerate((e[0], e[3]) for e in ev) if i == 0 or k != (ev[i - 1][0], ev[i - 1][3])]
    return len(runs) - len(set(runs))


def test_auto_overlaps_where_the_all_to_alls_cross_nodes(world):
    """--pp-overlap auto: the pairs interleave where the ep group's all-to-alls (flat, or the
    node-aware route's) cross nodes, not inside one node, not without ep. tests/test_pp_ep_overlap.py
    runs it on one node and again with every rank a node of its own (PYMPAR_RANKS_PER_NODE=1), so
    both answers are seen."""
    if world.size != 4:
        pytest.skip("runs at 4 ranks")
    one_node = os.environ.get("PYMPAR_RANKS_PER_NODE") != "1"
    for ep, dispatch in [(2, "flat"), (1, "flat")] + ([] if one_node else [(2, "node")]):
        lay = Layout(dp=2, pp=2, ep=ep, model="moe", schedule="dualpipev", virtual_stages=2, micro_batch_size=2,
                     n_micro=G // 2)
        opts = opts_of(lay)
        opts.pp_overlap, opts.ep_dispatch = "auto", dispatch
        runner = ParallelRunner(CFG, lay, world, opts, optim_of(lay))
        runner.train_step(global_batch(0, CFG.vocab_size)[:lay.n_micro], LR[lay.dtype])
        want = ep > 1 and not one_node
        assert (runner.executor.stats["overlapped_pairs"] > 0) == want, \
            (ep, dispatch, one_node, runner.executor.stats["overlapped_pairs"])
        free_mesh(runner.mesh)
