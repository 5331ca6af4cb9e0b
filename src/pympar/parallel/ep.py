"""Expert parallelism: the experts of every MoE layer spread over the ep group, tokens moved by alltoallv.

Layout. ``ep`` divides ``dp``; the ep group is ``ep`` data-parallel ranks (pympar.parallel.mesh:
ep_rank = dp_rank % ep). Rank ``r`` of the ep group holds the ``n_local = n_expert / ep`` whole
experts ``[r*n_local, (r+1)*n_local)``; under tensor parallelism each of them is further split
along its hidden width over tp (TPMoE), so EP and TP compose without knowing of each other.
Folded (mesh etp < tp): the ep group may take tp ranks too, each bringing its share of the rows
its tp group routed (parallel/tp/moe.py); the dispatch below is the same.
Expert parameters keep their GLOBAL names ``transformer.h.{i}.moe.experts.{e}.*``.

Dispatch, per MoE layer and micro-batch (``install_expert_parallel`` attaches an ``ExpertParallel``
to the layer, which nn.MoE calls between its kept assignments and its local experts; routing,
capacity, gates and the aux/z losses are unchanged). Each rank
routes ITS OWN micro-batch exactly as the single-process model routes that micro-batch alone:
capacity (ceil(k * N * cf / E) with N the micro-batch's tokens) and drops are decided on the
source rank before anything moves, so the kept tokens are the single-process model's. Then:

    counts (ep, n_local) --alltoall-->  recv_by (ep, n_local)  rows each source sends each local expert
    xs (M, C) --alltoallv-->  xr (R, C)  source-major; regroup expert-major, run the local experts
    yr (R, C) --alltoallv-->  ys (M, C)  back in the source's order; combined with the gates there
Backward sends dys the same way and brings dxs back (two alltoallv, the counts are reused).

Gradients. With the trainer's grad_scale = 1/n_micro, a dense gradient on a rank is
(1/n_micro) * sum over its micro-batches; the mean over dp gives (1/G) * sum over all
G = dp * n_micro micro-batches -- the single-process gradient. An expert on ep rank r receives
tokens from the micro-batches of all ep ranks of its group, so its local gradient is
(1/n_micro) * sum over the group's micro-batches; SUMMING over the edp group (the dp/ep ranks
that hold the same expert, one per ep group) covers every micro-batch once, so

    expert grad = sum over edp / dp  =  (mean over edp) / ep

which is what the trainer's gradient path does (pympar.parallel.gradsync: an expert's
placement puts it in the edp group with the factor edp / (dp*cp), mesh.expert_grad_scale: 1/ep
unfolded).
Global-norm clipping: after the sync dense grads are identical on every dp rank and count
once; expert grads are identical over edp and distinct over ep, so every ep rank counts its own.
"""
from __future__ import annotations

import itertools

import numpy as np

from .. import kernels
from ..backend import to_numpy, xp_of
from ..comm.algorithms.node_a2a import NodeRoute, Plan
from .mesh import divisors as divisors_of
from ..nn.layers import MLP
from ..nn.wgrad import accumulate, deferring
from . import overlap
from .meter import Meter, Tally
from .placement import place
from .replicas import max_over_mean, split

def validate_ep(config, ep: int) -> None:
    """Raise ValueError unless the experts divide over ep ranks (no communication); config: anything
    with ``n_expert`` (a GPTConfig or a MoE layer)."""
    if not isinstance(ep, (int, np.integer)) or ep < 1:
        raise ValueError(f"ep={ep!r} must be a positive integer")
    if ep > 1 and not config.n_expert:
        raise ValueError(f"ep={ep} needs a MoE model (n_expert > 0)")
    if ep > 1 and config.n_expert and config.n_expert % ep:
        divisors = divisors_of(config.n_expert)
        raise ValueError(f"n_expert={config.n_expert} is not divisible by ep={ep}: each ep rank holds "
                         f"n_expert/ep whole experts, so ep must be one of {divisors}")


def expert_range(n_expert: int, ep: int, ep_rank: int):
    """(lo, hi): the global expert ids held by ep rank ``ep_rank``."""
    if n_expert % ep:
        raise ValueError(f"n_expert={n_expert} is not divisible by ep={ep}")
    n_local = n_expert // ep
    return ep_rank * n_local, (ep_rank + 1) * n_local


# --- the dispatch ------------------------------------------------------------------------------
def _expert_major(recv_by):
    """recv_by (ep, n_local) host counts -> perm (R,) host int64: rows of the source-major buffer in
    expert-major order (the caller moves it to the rows' device once)."""
    sizes = recv_by.reshape(-1)
    starts = np.cumsum(sizes) - sizes                       # host: block (s, j) starts here (s-major)
    starts, sizes = starts.reshape(recv_by.shape).T.reshape(-1), recv_by.T.reshape(-1)
    if not sizes.sum():
        return np.zeros(0, np.int64)  # host
    return np.concatenate([np.arange(a, a + n) for a, n in zip(starts.tolist(), sizes.tolist()) if n])  # host


class ExpertParallel:
    """A MoE layer's experts spread over an ep group: attached as ``layer.expert_parallel`` by
    ``install_expert_parallel`` (nn.MoE declares it). The layer keeps its routing; between its kept
    assignments and its local experts (``layer.run_experts``) this object moves the rows over the ep
    group, holds the replicated hot experts, and counts what the rank ran."""

    def __init__(self, layer, ep_comm, lo, hi, meter, key, route=None):
        self.layer, self.comm = layer, ep_comm
        self.lo, self.n_local = lo, hi - lo
        self.meter, self.key = meter, key                  # the all-to-alls' seconds and bytes go there
        self.route = route                                 # a NodeRoute when the layer dispatches node-aware
        self.reset()

    def reset(self):
        # host counters: the counts behind them are on the host already (they travel over MPI).
        # processed: rows this rank ran per global expert (replicas count for their expert);
        # rank_rows: all rows it ran (its load, replicas included)
        E = self.layer.n_expert
        self.acc = dict(processed=np.zeros(E, np.int64), routed=np.zeros(E, np.int64),  # host
                        kept=0, assignments=0, rank_rows=0)

    def _a2a(self, x, send, recv):
        # inside DualPipeV's overlapped pair (parallel/overlap.py) the partner computes while the
        # rows travel; the meter gets this strand's own seconds in the exchange (the exposed time)
        x = xp_of(x).ascontiguousarray(x)                                 # rows on x's device
        (out, _), secs = overlap.exchange(lambda: self.comm.alltoallv(x, send, recv),
                                          lambda: self.comm.ialltoallv(x, send, recv))
        self.meter.add(self.key, secs, x.nbytes)
        return out

    # --- replicated hot experts (parallel/replicas.py) ------------------------------------------
    copies = None                                # E lists of ranks holding each expert (home first)
    replica_modules = ()                         # this rank's replica MLPs, in slot order (not parameters)
    _rep_slots = None                            # per rank the global experts it runs: home, then replicas
    _rep_slot_of = None                          # (expert, rank) -> that copy's slot on the rank

    def _slots(self, r):
        """The global experts rank r runs, in slot order: its home experts, then its replicas."""
        if self._rep_slots is None:
            return list(range(r * self.n_local, (r + 1) * self.n_local))
        return self._rep_slots[r]

    def set_replicas(self, copies):
        """Run with these copies (parallel.replicas.place_replicas; None: home experts only), the same
        on every rank of the ep group. Collective over it: the replicas get their home's weights."""
        nl, L = self.n_local, self.layer
        if copies is not None:
            if len(copies) != L.n_expert or any(c[0] != e // nl for e, c in enumerate(copies)):
                raise ValueError("set_replicas: every expert's copies must start with its home rank")
            if any(type(m) is not MLP for m in L.experts):
                raise ValueError("replicated experts need plain MLP experts (no tensor parallelism)")
            if any(p.shard is not None or p.grad_shape is not None for p in self._params(L.experts[0])):
                raise ValueError("replicated experts need whole expert weights on their home rank (not ZeRO-3)")
        self.copies = [list(c) for c in copies] if copies is not None else None
        self._rep_slots = self._rep_slot_of = None
        if copies is not None:                       # derived once: every forward routes by them
            self._rep_slots = [list(range(r * nl, (r + 1) * nl)) + [e for e, c in enumerate(copies) if r in c[1:]]
                               for r in range(self.comm.size)]
            self._rep_slot_of = {(e, r): j for r, es in enumerate(self._rep_slots) for j, e in enumerate(es)}
        mine = self._slots(self.comm.rank)[nl:]
        proto = L.experts[0]
        self.replica_modules = [proto.empty_like(f"replica.{e}") for e in mine]
        xp = xp_of(proto.c_fc.weight.data)
        for m in self.replica_modules:               # storage only: refresh_replicas writes every value
            for p in self._params(m):
                p.data = xp.empty(p.shape, p.dtype)
        self.refresh_replicas()

    def _rep_pairs(self, src, dst):
        """Experts homed on src that have a replica on dst, ascending (the order their weights travel)."""
        nl = self.n_local
        return [e for e in range(src * nl, (src + 1) * nl) if dst in self.copies[e][1:]]

    @staticmethod
    def _params(m):
        return [p for p in m.weights_and_biases() if p is not None]

    def _exchange(self, blocks_for, size_of):
        """One alltoallv over the ep group of float vectors: blocks_for(dst) -> arrays to send there;
        size_of(src) -> elements arriving from src. Returns the received flat vector's blocks by source."""
        ep = self.comm
        w = self.layer.experts[0].c_fc.weight.data
        xp, dt = xp_of(w), w.dtype
        out = [[b.reshape(-1) for b in blocks_for(d)] for d in range(ep.size)]
        buf = xp.concatenate([v for o in out for v in o] or [xp.zeros(0, dt)]).astype(dt, copy=False)
        send = np.array([sum(v.size for v in o) for o in out], np.int64)  # host
        recv = np.array([size_of(s) for s in range(ep.size)], np.int64)  # host
        got, _ = ep.alltoallv(buf, send, recv)
        starts = [0, *itertools.accumulate(recv.tolist())]
        return [got[starts[s]:starts[s + 1]] for s in range(ep.size)]

    def refresh_replicas(self):
        """The replicas take their home experts' current weights (after every optimizer step)."""
        if self.copies is not None:
            self._replica_move(to_replicas=True)

    def _fold_replica_grads(self):
        """The replicas' gradients of this backward added to their home experts' (in source-rank
        order), and the replicas' cleared: only home experts are parameters."""
        self._replica_move(to_replicas=False)
        for m in self.replica_modules:
            m.zero_grad()

    def _replica_move(self, to_replicas: bool):
        """One alltoallv between each home expert and its replicas: the home's weights to the replicas
        (to_replicas), or the replicas' gradients to the home, added there."""
        me, nl = self.comm.rank, self.n_local
        home = {self.lo + j: m for j, m in enumerate(self.layer.experts)}
        mine = dict(zip(self._slots(me)[nl:], self.replica_modules))
        n_w = sum(p.data.size for p in self._params(self.layer.experts[0]))
        if to_replicas:                              # (sent by src=me, held on dst) / arriving from s
            out, into = lambda d: self._rep_pairs(me, d), lambda s: self._rep_pairs(s, me)
            src, dst, what = home, mine, (lambda p: p.data)
        else:
            out, into = lambda d: self._rep_pairs(d, me), lambda s: self._rep_pairs(me, s)
            src, dst, what = mine, home, (lambda p: p.grad)
        got = self._exchange(lambda d: [what(p) for e in out(d) for p in self._params(src[e])],
                             lambda s: n_w * len(into(s)))
        for s in range(self.comm.size):
            at = 0
            for e in into(s):
                for p in self._params(dst[e]):
                    g = got[s][at:at + p.data.size].reshape(p.data.shape)
                    if to_replicas:
                        p.data[...] = g
                    else:
                        accumulate(p, g)
                    at += p.data.size

    def _routes(self, counts):
        """(per_dest (ep, slots) rows each rank's slots get from here, the order of xs's rows as they
        leave, or None when that is xs's own order). Each expert's rows split evenly over its copies."""
        ep, nl = self.comm.size, self.n_local
        c = np.asarray(to_numpy(counts), np.int64)  # host
        if self.copies is None:
            return np.ascontiguousarray(c.reshape(ep, nl)), None  # host
        slot_of = self._rep_slot_of
        n_slots = max(len(es) for es in self._rep_slots)
        starts = np.concatenate([[0], np.cumsum(c)])  # host
        segs = []
        for e, cps in enumerate(self.copies):
            for (a, b), r in zip(split(int(c[e]), len(cps)), cps):
                if b > a:
                    segs.append((r, slot_of[e, r], int(starts[e]) + a, b - a))
        segs.sort()
        per_dest = np.zeros((ep, n_slots), np.int64)  # host
        for r, j, a, n in segs:
            per_dest[r, j] += n
        order = np.concatenate([np.arange(a, a + n) for _, _, a, n in segs]) if segs else np.zeros(0, np.int64)  # host
        return per_dest, order

    # --- the flat dispatch: the layer's kept rows -> their experts' ranks -> back --------------
    def run_experts(self, xs, counts):           # xs (M, C) grouped by global expert, counts (E,)
        # The counts decide the message sizes: they come to the host once (one device sync on a GPU)
        # and every count below is a host int64 vector (alltoall of a host vector goes over MPI).
        xp, L = xp_of(xs), self.layer
        per_dest, order = self._routes(counts)               # host (ep, slots); rows' leaving order
        got, secs = overlap.exchange(lambda: self.comm.alltoall(per_dest), lambda: self.comm.ialltoall(per_dest))
        recv_by = np.asarray(got).reshape(per_dest.shape)                             # host
        self.meter.add(self.key, secs, calls=0)                      # the counts: not a2a_bytes
        send, recv = per_dest.sum(axis=1), recv_by.sum(axis=1)                        # (ep,) rows, host
        order = None if order is None else xp.asarray(order)
        xr = self._a2a(xs if order is None else xs[order], send, recv)   # (R, C) source-major
        perm = xp.asarray(_expert_major(recv_by))            # (R,) built on the host, moved once
        local_counts = recv_by.sum(axis=0)                   # (slots,) host
        if self.copies is None:
            yg, inner = L.run_experts(xr[perm], local_counts)   # (R, C) expert-major
        else:
            yg, inner = L.run_experts(xr[perm], local_counts, experts=[*L.experts, *self.replica_modules])
        yr = xp.empty_like(yg)
        yr[perm] = yg
        ys = self._a2a(yr, recv, send)                       # (M, C) in the leaving order
        if order is not None:
            back = xp.empty_like(ys)
            back[order] = ys
            ys = back
        if L.recording:
            a = self.acc
            mine = self._slots(self.comm.rank)
            np.add.at(a["processed"], mine, local_counts[:len(mine)])  # host
            a["rank_rows"] += int(local_counts.sum())
        return ys, (send, recv, perm, inner, order)

    def run_experts_backward(self, dys, ctx):    # dys (M, C) -> dxs (M, C)
        send, recv, perm, inner, order = ctx
        dr = self._a2a(dys if order is None else dys[order], send, recv)   # (R, C) source-major
        dxg = self.layer.run_experts_backward(dr[perm], inner)
        dxr = xp_of(dxg).empty_like(dxg)
        dxr[perm] = dxg
        dxs = self._a2a(dxr, recv, send)
        if order is not None:
            back = xp_of(dxs).empty_like(dxs)
            back[order] = dxs
            dxs = back
        if self.copies is not None:
            if deferring():                          # the replicas' weight gradients would come later
                raise ValueError("replicated experts cannot run under a deferred W pass (zero-bubble schedules)")
            self._fold_replica_grads()
        return dxs

    def record_routing(self, ctx):
        """After a recording forward: the assignments this rank routed (before and after dropping)."""
        B, T, _ = ctx["shape"]
        a = self.acc
        a["routed"] += np.asarray(to_numpy(ctx["counts"]), np.int64)   # host: E counts (this rank's tokens)
        a["kept"] += len(ctx["order"])
        a["assignments"] += B * T * self.layer.top_k

    # --- node-aware dispatch (comm/algorithms/node_a2a.py): tokens cross to a node once -------
    def takes(self, xf):
        """Does the node-aware route run for these rows (the route is set, the rows are host arrays)?"""
        return self.route is not None and type(xf) is np.ndarray

    @staticmethod
    def owns(ctx):
        """Is ctx node_forward's (the layer's experts_backward hands it back here)?"""
        return isinstance(ctx, tuple) and bool(ctx) and isinstance(ctx[0], Plan)

    def node_forward(self, xf, rows, gate_rows, counts):
        L, nl = self.layer, self.n_local
        c = np.asarray(counts, np.int64)  # host: NumPy arrays only on this path
        expert = np.repeat(np.arange(len(c)), c)              # host: global expert of each kept assignment
        dest = expert // nl
        gates = np.ascontiguousarray(gate_rows, np.float64)   # host: float32 gates widen exactly
        t0 = overlap.clock()                                  # (this strand's own seconds in a pair)
        plan = self.route.plan(np.asarray(rows), dest, np.stack([expert - dest * nl, gates.view(np.int64)], axis=1))  # host
        xr = plan.dispatch(xf)                                # (R, C): a row per (token, rank)
        self._tally(t0, plan, xf, True)
        j = plan.meta[:, 0]
        perm = np.argsort(j, kind="stable")                   # host: arriving assignments, expert-major
        arow = plan.arow[perm]
        g = plan.meta[perm, 1].copy().view(np.float64).astype(gate_rows.dtype)
        local_counts = np.bincount(j, minlength=nl)  # host
        ys, inner = L.run_experts(kernels.permute(xr, arow), local_counts)
        z = kernels.unpermute_add(ys, arow, g, plan.n_rows)   # this rank's gated sum per row
        t0 = overlap.clock()
        y = plan.combine(z, xf.shape[0])
        self._tally(t0, plan, z, False)
        if L.recording:
            self.acc["processed"][self.lo:self.lo + nl] += local_counts
            self.acc["rank_rows"] += int(local_counts.sum())
        return y, (plan, perm, arow, g, ys, inner)

    def node_backward(self, dyf, ctx):
        L = self.layer
        plan, perm, arow, g, ys, inner = ctx
        t0 = overlap.clock()
        dr = plan.dispatch(dyf)
        self._tally(t0, plan, dyf, True)
        dys_raw = kernels.permute(dr, arow)
        dgate = np.einsum("mc,mc->m", dys_raw.astype(L._acc, copy=False), ys.astype(L._acc, copy=False))  # host
        dxs = L.run_experts_backward(dys_raw * g[:, None].astype(dys_raw.dtype), inner)
        t0 = overlap.clock()
        dxf = plan.combine(kernels.unpermute_add(dxs, arow, None, plan.n_rows), dyf.shape[0])
        v = np.empty(len(perm), np.float64)  # host
        v[perm] = dgate
        back = plan.reverse(v.view(np.int64)[:, None])        # each assignment's value, the source's order
        self._tally(t0, plan, dyf, False)
        return dxf, back[:, 0].copy().view(np.float64).astype(L._acc)

    def _tally(self, t0, plan, x, out):
        """Meter the route's exchange that began at overlap.clock() t0 (this strand's own seconds)."""
        self.meter.add(self.key, overlap.clock() - t0, self._hop_bytes(plan, x, out))

    @staticmethod
    def _hop_bytes(plan, x, out):
        """Row bytes this rank sends in both hops: dispatch (out) or combine."""
        rows = (plan.c1.sum() + plan.c2.sum()) if out else (plan.rc1.sum() + plan.rc2.sum())
        return int(rows) * x.shape[-1] * x.itemsize

    def take_stats(self):
        """This rank's raw counters since the last call (resets them)."""
        a = self.acc
        self.reset()
        return a


def moe_layers_of(model):
    """[(layer index, MoE layer)] of a GPT/TPGPT/PipelineGPT (its moe_layers())."""
    return list(model.moe_layers())


DISPATCH = ("auto", "flat", "node")


class NodeRouteError(ValueError):
    """ep_dispatch='node' where the ep group cannot take the two-hop route (every rank of the group
    raises it: the check is collective)."""
    MESSAGE = ("ep_dispatch='node' needs every ep group over several nodes with equally many of its ranks on "
               "each (set PYMPAR_RANKS_PER_NODE to simulate nodes on one machine, or use --ep-dispatch auto)")


def node_route(ep_comm, dispatch: str = "auto", top_k: int = 2):
    """The NodeRoute the MoE layers share for ``dispatch`` over ep_comm, or None (flat alltoallv).
    "flat": None; "node": the two-hop route (an error when the ep group is on one node or its nodes
    are uneven); "auto": the route where it can cut network bytes -- the group spans nodes of equal
    size and a token has several experts (top_k > 1) -- else None. Collective over ep_comm."""
    if dispatch not in DISPATCH:
        raise ValueError(f"ep_dispatch={dispatch!r}: expected one of {DISPATCH}")
    if dispatch == "flat" or ep_comm.size == 1 or (dispatch == "auto" and top_k < 2):
        return None
    route = NodeRoute.build(ep_comm)
    if route is None and dispatch == "node":
        raise NodeRouteError(NodeRouteError.MESSAGE)
    if route is not None:
        route.exchange = _exchange               # each hop a hand-over point inside DualPipeV's pairs
    return route


def _exchange(blocking, start):
    """The node-aware route's exchanges (NodeRoute.exchange): blocking outside an interleaved pair;
    inside one, started and handed over to the partner strand (overlap.exchange)."""
    return overlap.exchange(blocking, start)[0]


def install_expert_parallel(model, ep_comm, meter: Meter | None = None, dispatch: str = "flat"):
    """Keep only this ep rank's experts in every MoE layer of ``model`` and route tokens over ep_comm.

    The model must have been built from (config, seed) like every other rank's: the kept experts are
    then exactly the full model's experts [lo, hi) (init depends on (seed, global name) only). All
    experts exist transiently during the model's construction. Layer i's all-to-alls report their
    seconds and bytes to ``meter`` under ("ep", i) (pympar.parallel.meter; a new Meter when None).
    Returns the model."""
    meter = Meter() if meter is None else meter
    layers = moe_layers_of(model)
    if any(getattr(m, "_fold", None) is not None for _, m in layers):   # the same on every rank: the layout's
        if dispatch == "node":                   # the two-hop route combines in place of the shares' gather
            raise ValueError("ep_dispatch='node' does not run with the experts folded apart from tp (etp < tp): "
                             "use --ep-dispatch auto or flat")
        route = None
    else:
        route = node_route(ep_comm, dispatch, max((m.top_k for _, m in layers), default=1))
    for i, layer in layers:
        validate_ep(layer, ep_comm.size)
        lo, hi = expert_range(layer.n_expert, ep_comm.size, ep_comm.rank)
        if len(layer.experts) != layer.n_expert:
            raise ValueError(f"MoE layer holds {len(layer.experts)} experts, expected all {layer.n_expert} "
                             "before installing expert parallelism")
        if layer.expert_parallel is not None:
            raise ValueError(f"MoE layer {i} already has expert parallelism installed")
        layer.experts = layer.experts[lo:hi]            # local experts, local index j = e - lo
        layer.expert_lo = lo                            # their parameters keep their global names
        if ep_comm.size > 1:                            # held by one ep rank: reduced over edp
            place([p for e in layer.experts for p in e.parameters()], group="edp")
        layer.expert_parallel = ExpertParallel(layer, ep_comm, lo, hi, meter, ("ep", i), route)
    model.ep_comm = ep_comm
    model.ep_route = route
    return model


# --- gradients, clipping, statistics -------------------------------------------------------------
def ep_step_stats(model, meter, dp_comm=None):
    """Per MoE layer, over all dp ranks since the last call: tokens_per_expert (kept tokens each
    expert processed), load_cv and max_over_mean of that load, routed_per_expert (assignments
    before dropping), dropped_fraction, a2a_seconds (mean over dp ranks of the time inside the
    alltoall/alltoallv calls), a2a_bytes (sent, summed over ranks), rows_per_rank (the rows each dp rank's
    experts ran, replicas included) and rank_max_over_mean of it. ``meter``: the one the layers
    were installed with; its ("ep", layer) tallies are taken (reset), the rest left. One allreduce per call."""
    layers = moe_layers_of(model)
    if not layers:
        return []
    n_dp, dp_rank = (1, 0) if dp_comm is None else (dp_comm.size, dp_comm.rank)
    rows, tallies = [], meter.take(lambda k: isinstance(k, tuple) and k[0] == "ep")
    for i, m in layers:
        a, t = m.expert_parallel.take_stats(), tallies.get(("ep", i), Tally())
        per_rank = np.zeros(n_dp, np.float64)  # host: the counters are host vectors
        per_rank[dp_rank] = a["rank_rows"]
        counters = [a["processed"], a["routed"], [a["kept"], a["assignments"], t.bytes, t.seconds], per_rank]
        rows.append(np.concatenate(counters))  # host
    vec = np.concatenate(rows).astype(np.float64)  # host
    n = 1
    if dp_comm is not None and dp_comm.size > 1:
        red = dp_comm.allreduce(vec)
        vec, n = (vec if red is None else np.asarray(red)), dp_comm.size  # host
    out, lo = [], 0
    for (i, m), r in zip(layers, rows):
        v = vec[lo:lo + len(r)]
        lo += len(r)
        E = m.n_expert
        load = v[:E]
        mean = load.mean()
        kept, assign, nbytes, secs = v[2 * E:2 * E + 4]
        per_rank = v[2 * E + 4:]
        out.append(dict(layer=i, tokens_per_expert=[int(round(t)) for t in load],
                        rows_per_rank=[int(round(t)) for t in per_rank], rank_max_over_mean=max_over_mean(per_rank),
                        load_cv=float(load.std() / mean) if mean > 0 else 0.0,
                        max_over_mean=float(load.max() / mean) if mean > 0 else 0.0,
                        routed_per_expert=[int(round(t)) for t in v[E:2 * E]],
                        dropped_fraction=float(1.0 - kept / assign) if assign else 0.0,
                        a2a_seconds=float(secs / n), a2a_bytes=int(round(nbytes))))
    return out
