"""The planner's cost model: what a layout costs per rank and which layout to run.

``predict(model, layout, machine)``: memory = the ledger of the worst pipeline rank + the process
baseline; compute = the model's FLOPs at the matmul rate + the non-matmul activation work + a
per-block overhead; tp, ep, pp, cp and dp communication in the alpha-beta model with each
collective's bus factor; the pipeline's bubble from the schedule simulator of
pympar.parallel.pp. ``enumerate_layouts`` yields every layout of a world, ``plan`` predicts them
all and ``choose`` keeps the best that fits in memory and passes ``layout.check`` (the trainer's
``--layout auto``). The constants and their sources: pympar/plan/cli.py's docstring, whose
command line (``python -m pympar.plan``) prints and measures these predictions.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import asdict, dataclass, field, replace

from ..layout import Layout, check
from ..nn.config import GPTConfig, flops_per_token
from ..parallel import ledger
from ..parallel.cp import a2a_group_sizes, validate_cp
from ..parallel.mesh import divisors
from ..parallel.pp import schedules as S
from ..parallel.pp.partition import partition, validate_pipeline
from ..parallel.tp.validate import validate_tp
from ..nn.gpt import RECOMPUTE


GiB = 1024 ** 3

# peak FLOP/s (bf16 dense) and link bandwidths (bytes/s) of GPU models; cpu is measured.
DEVICES = {
    "a100": dict(peak=312e12, intra_bw=240e9, inter_bw=25e9, alpha=10e-6, mem=80 * GiB, act_bytes=2, overhead=3e-5),
    "h100": dict(peak=989e12, intra_bw=360e9, inter_bw=50e9, alpha=8e-6, mem=80 * GiB, act_bytes=2, overhead=3e-5),
    "h200": dict(peak=989e12, intra_bw=360e9, inter_bw=50e9, alpha=8e-6, mem=141 * GiB, act_bytes=2, overhead=3e-5),
}
# cpu without --calibration: FITTED TO THE DEVELOPMENT VM, not measured where it runs --
# bench/plan_calibrate.py on the 2-core VM, 4 ranks (alpha per round:
# 1.7 ms for an 8 B allreduce of 2 rounds; busbw 0.35 GB/s at 8 MiB; the per-micro-batch fixed
# cost fitted below the noise, so overhead 0)
CPU_DEFAULT = dict(alpha=0.85e-3, intra_bw=0.35e9, inter_bw=0.35e9, act_bytes=4, overhead=0.0)
# fraction of the matmul peak a training step reaches. cpu: the peak is a 256^3 float32 burst;
# a whole step of the small preset ran at 1.0-1.2x that rate (bench/plan_accuracy.py, 4 ranks on
# 2 cores), larger GEMMs than the burst's; 0.5 had predicted every step 2.5x too slow.
MFU_ASSUMED = {"cpu": 1.0, "gpu": 0.45}


def is_moe_layer(cfg: GPTConfig, i: int) -> bool:
    return cfg.is_moe_block(i)


def parse_bytes(s) -> int:
    s = str(s).strip()
    units = {"k": 1024, "m": 1024 ** 2, "g": GiB, "t": 1024 ** 4}
    low = s.lower().rstrip("ib").rstrip("b") if s.lower().endswith(("ib", "b")) else s.lower()
    if low and low[-1] in units:
        return int(float(low[:-1]) * units[low[-1]])
    return int(float(low))



@dataclass
class Prediction:
    layout: Layout
    memory: dict = field(default_factory=dict)     # bytes per rank by kind, the worst rank
    time: dict = field(default_factory=dict)       # seconds per step by kind
    step_time: float = 0.0
    bubble: float = 0.0
    peak_in_flight: int = 0

    def row(self) -> dict:
        return {"layout": self.layout.key(), **asdict(self.layout), "step_time_s": self.step_time,
                "memory_bytes": self.memory.get("total", 0), "bubble": self.bubble,
                "memory": self.memory, "time": self.time, "peak_in_flight": self.peak_in_flight}


# --- the machine: alpha-beta constants -------------------------------------------------
@dataclass
class Machine:
    peak: float                  # matmul FLOP/s per rank
    alpha: float                 # collective latency, s
    intra_bw: float              # bytes/s of a collective's bus inside a node
    inter_bw: float              # bytes/s across nodes
    mem: int                     # bytes per rank
    act_bytes: int               # bytes per activation element
    mfu: float                   # fraction of peak a step reaches
    ranks_per_node: int
    overlap: float               # fraction of the DP sync hidden behind backward
    overhead: float = 0.0        # fixed seconds per block and micro-batch (Python, kernel launches)
    cores: int = 0               # cores per node when ranks share them (CPU); 0 = a device per rank
    elem_time: float = 0.0       # seconds per activation element produced (non-matmul work)
    opt_per_param: float = 4e-9  # optimiser step seconds per parameter (~40 B touched at ~10 GB/s)
    baseline: int = 0            # bytes of a rank's process before its model (interpreter, libraries)
    arrival_curve: tuple = ()    # ((burst s, spread s), ...): measured wait for the last rank (calibration)
    slowdown: tuple = ()         # (ranks k, factor): measured compute slowdown of k ranks on the node

    def arrival(self, burst: float) -> float:
        """Seconds a collective after ``burst`` seconds of compute waits for the last rank to arrive,
        beyond its own latency: the calibration's measured points, linear between them (from 0 at
        no compute to the first point), the last point's beyond it; 0 without a calibration."""
        pts = self.arrival_curve
        if not pts or burst <= 0:
            return 0.0
        x0, y0 = 0.0, 0.0
        for x1, y1 in pts:
            if burst <= x1:
                return y0 + (y1 - y0) * (burst - x0) / (x1 - x0) if x1 > x0 else y1
            x0, y0 = x1, y1
        return y0

    def oversubscription(self, ranks_on_node: int) -> float:
        """How much slower a rank computes than alone where ranks share cores: ranks / cores, times
        the excess the calibration measured over ranks / cores at its rank count k (exactly its
        factor at k); 1 where every rank has a core."""
        if not self.cores or ranks_on_node <= self.cores:
            return 1.0
        share = ranks_on_node / self.cores
        if self.slowdown:
            k, factor = self.slowdown
            share *= max(1.0, factor / max(1.0, k / self.cores))
        return share

    def coll(self, kind: str, nbytes: float, k: int, cross_node: bool) -> float:
        """Alpha-beta time of a collective of ``nbytes`` over k ranks."""
        if k <= 1 or nbytes <= 0:
            return 0.0
        factor = {"allreduce": 2 * (k - 1) / k, "reduce_scatter": (k - 1) / k,
                  "allgather": (k - 1) / k, "alltoall": (k - 1) / k, "sendrecv": 1.0}[kind]
        bw = self.inter_bw if cross_node else self.intra_bw
        steps = math.ceil(math.log2(k)) if kind == "allreduce" else 1
        return self.alpha * steps + factor * nbytes / bw



# --- the model's parameter and activation counts per rank ------------------------------
def params_per_rank(cfg: GPTConfig, lay: Layout, stage_blocks, first: bool, last: bool) -> int:
    """Parameter elements of a rank (the ledger's count, pympar.parallel.ledger)."""
    return ledger.params_per_rank(cfg, lay.tp, lay.ep, stage_blocks, first, last, lay.etp)


def activations_per_micro(cfg: GPTConfig, lay: Layout, stage_blocks, last: bool) -> float:
    """Activation elements a stage produces per micro-batch: the non-matmul work of the time
    model (memory is the ledger's, pympar.parallel.ledger)."""
    B, T, C, H, tp = lay.micro_batch_size, cfg.block_size // lay.cp, cfg.n_embd, cfg.n_head, lay.tp
    rep = 4.0 / tp if lay.seq_parallel else 4.0        # block input, ln_1 out, residual, ln_2 out
    n = 0.0
    for i in stage_blocks:
        n += B * T * C * rep + B * T * C * 5.0 / tp + 2.0 * B * H * T * T * lay.cp / tp   # qkv, attn out, scores+probs
        if is_moe_layer(cfg, i):
            tok = B * T * cfg.top_k
            n += tok * (C + 8.0 * C / tp) + B * T * cfg.n_expert * 2
        else:
            n += B * T * 8.0 * C / tp                   # c_fc out and GELU out
    if last:
        vpad = -(-cfg.vocab_size // tp) * tp
        n += B * T * (C * 2 + vpad / tp)               # ln_f in/out, vocab-parallel logits
    return n


def cp_attention_time(lay: Layout, m: Machine, u: float) -> float:
    """Seconds of one block's context-parallel attention traffic per micro-batch (forward and
    backward) not hidden behind compute; u = the bytes of this rank's share of one activation
    (its positions' q, k or v of its tp heads).

    ring: per block cp-1 key/value hops forward, cp-1 more backward and cp-1 dK/dV partials sent to
    their blocks' owners (2u each on the rank that sends the most), each hidden behind the block in
    hand as far as the machine's overlap allows; crosses nodes when the cp group does. a2a: q, k,
    v (3u) and the output (u) through an all-to-all forward, the same backward, none of it hidden
    (attention waits for it). a2a+ring: those all-to-alls inside groups of cp_a2a consecutive ranks
    (crossing nodes only when a group does), then the ring of the cp/cp_a2a groups on k, v blocks
    of the same size (the group's positions, its heads)."""
    if lay.cp <= 1:
        return 0.0
    tp_span = lay.tp * lay.cp > m.ranks_per_node

    def ring(r, cross):
        return 3 * (r - 1) * m.coll("sendrecv", 2 * u, 2, cross) * (1 - m.overlap) if r > 1 else 0.0

    def a2a(k, cross):
        return 2 * (m.coll("alltoall", 3 * u, k, cross) + m.coll("alltoall", u, k, cross))
    if lay.cp_comm == "a2a":
        return a2a(lay.cp, tp_span)
    if lay.cp_comm == "a2a+ring":
        k = lay.cp_a2a
        return a2a(k, lay.tp * k > m.ranks_per_node) + ring(lay.cp // k, tp_span)
    return ring(lay.cp, tp_span)


def cp_comms(cfg: GPTConfig, cp: int, tp: int) -> list:
    """(cp_comm, cp_a2a) the planner considers: the ring, Ulysses where each tp rank's heads split
    over cp, and Ulysses in groups of every proper divisor of cp with the ring across them."""
    if cp <= 1:
        return [("ring", 0)]
    heads = cfg.n_head // tp
    return [("ring", 0)] + ([("a2a", 0)] if heads % cp == 0 else []) + \
        [("a2a+ring", u) for u in a2a_group_sizes(cp, heads)]


# --- prediction ---------------------------------------------------------------------------
def predict(cfg: GPTConfig, lay: Layout, m: Machine) -> Prediction:
    part = partition(cfg, lay.pp, lay.virtual_stages, placement=S.placement_of(lay.schedule))
    B, T, C = lay.micro_batch_size, cfg.block_size // lay.cp, cfg.n_embd     # T: this rank's positions
    tp_cross = lay.tp > m.ranks_per_node
    pp_cross = lay.tp * lay.cp * lay.pp > m.ranks_per_node
    dp_cross = lay.tp * lay.cp * lay.pp * lay.dp > m.ranks_per_node
    dpcp = lay.dp * lay.cp                             # the gradient group
    mem, worst_rank = ledger.predict(cfg, dp=lay.dp, pp=lay.pp, tp=lay.tp, ep=lay.ep, etp=lay.etp, zero=lay.zero,
                                     recompute=lay.recompute, sp=lay.seq_parallel, micro_batch_size=B,
                                     n_micro=lay.n_micro, schedule=lay.schedule, virtual_stages=lay.virtual_stages,
                                     act_bytes=m.act_bytes, cp=lay.cp, cp_comm=lay.cp_comm, cp_a2a=lay.cp_a2a)
    mem = dict(mem, baseline=m.baseline)
    mem["total"] = mem["peak"] + m.baseline
    stages = part.stages_of(worst_rank)
    blocks_w = [i for s_ in stages for i in part.blocks(s_)]
    n_par_worst = params_per_rank(cfg, lay, blocks_w, 0 in stages, (part.n_stage - 1) in stages)
    inflight = S.table_peaks(lay.schedule, lay.pp, lay.n_micro, lay.virtual_stages, worst_rank)[0]

    # per micro-batch forward+backward time of one rank (all its v chunks), at the rate of a
    # rank alone; ``slow`` stretches it when the node's ranks share fewer cores
    ranks_here = min(m.ranks_per_node, lay.dp * lay.pp * lay.cp * lay.tp)   # this layout's ranks on a node
    slow = m.oversubscription(ranks_here)
    tokens = B * T
    flops_micro = flops_per_token(cfg) * tokens / (lay.tp * lay.pp)   # PaLM's count: attention over all T, / cp
    elems = activations_per_micro(cfg, lay, range(cfg.n_layer), True) / lay.pp   # non-matmul work, mean stage
    comp = slow * (flops_micro / (m.peak * m.mfu) + m.elem_time * elems + m.overhead * (cfg.n_layer + 2) / lay.pp)
    # recomputation runs forward work again in backward: full, the whole forward (a third of the
    # step's matmul work) but a dense MLP's c_proj (its backward computes c_fc's output again);
    # selective, a dense MLP's c_fc and the attention scores and probabilities (the materialized
    # attention path; the tiled kernel recomputes them in any mode). Tensor-parallel MLPs keep
    # their hidden layer in every mode.
    fpt = flops_per_token(cfg)
    mlp = 0.0 if lay.tp > 1 else 8.0 * C * C * sum(1 for i in range(cfg.n_layer) if not is_moe_layer(cfg, i)) / fpt
    if lay.recompute == "full":
        comp *= 4.0 / 3.0 - mlp
    elif lay.recompute == "selective":
        att = 0.0 if ledger.tiled_attention(m.act_bytes) else 12.0 * cfg.n_layer * T * C / fpt / 3.0
        comp *= 1.0 + mlp + att
    blocks_per_rank = cfg.n_layer / lay.pp
    moe_per_rank = sum(1 for i in range(cfg.n_layer) if is_moe_layer(cfg, i)) / lay.pp
    act_b = tokens * C * m.act_bytes
    # 4 per block, + embedding (first stage) and cross-entropy's 2 (last stage): 3 spread over the stages
    tp_t = (4 * blocks_per_rank + 3 / lay.pp) * m.coll("allreduce", act_b, lay.tp, tp_cross)
    ep_t = 4 * moe_per_rank * m.coll("alltoall", act_b * cfg.top_k, lay.ep, dp_cross)
    if lay.folded:     # a share of the rows each (fold = tp/etp shares); the experts' sums over etp, not
        fold, etp = lay.tp // lay.etp, lay.etp        # tp; one allgather of the rows each way
        tp_t -= 2 * moe_per_rank * m.coll("allreduce", act_b, lay.tp, tp_cross)
        tp_t += 2 * moe_per_rank * m.coll("allreduce", act_b * cfg.top_k / fold, etp, tp_cross)
        ep_t = moe_per_rank * (4 * m.coll("alltoall", act_b * cfg.top_k / fold, lay.ep, dp_cross)
                               + 2 * m.coll("allgather", act_b * cfg.top_k, fold, tp_cross))
    # ranks reach each of these collectives from compute: where they outnumber the cores the last
    # arrives late, by what the calibration measured after bursts as long as the compute between two.
    # Sequence parallelism makes each allreduce an allgather and a reduce-scatter (two arrivals);
    # folded experts sum over etp (none at etp 1) and gather their rows over the fold
    n_tp = ((8 if lay.seq_parallel else 4) * blocks_per_rank + 3 / lay.pp) if lay.tp > 1 else 0.0
    if lay.folded:
        n_tp += 2 * moe_per_rank * ((lay.tp // lay.etp > 1) - (lay.etp == 1))
    n_ep = 4 * moe_per_rank if lay.ep > 1 else 0.0
    if n_tp + n_ep and m.cores and ranks_here > m.cores:
        spread = m.arrival(comp / (n_tp + n_ep))
        tp_t += n_tp * spread
        ep_t += n_ep * spread
    pp_t = m.coll("sendrecv", act_b, 2, pp_cross) if lay.pp > 1 else 0.0
    cp_t = blocks_per_rank * cp_attention_time(lay, m, tokens * C / lay.tp * m.act_bytes)
    f_cost = comp / 3 + (tp_t + ep_t) / 2 + cp_t / 3
    b_cost = 2 * comp / 3 + (tp_t + ep_t) / 2 + 2 * cp_t / 3
    # simulate() charges each of a rank's v chunks cost/v; every chunk boundary sends the full B*T*C
    sim = S.simulate(S.compiled_table(lay.schedule, lay.pp, lay.n_micro, lay.virtual_stages), lay.pp,
                     lay.virtual_stages, f_cost, b_cost, comm_cost=pp_t)
    pipe = sim["makespan"]
    busy = max(sim["busy"])
    grad_bytes = 4 * n_par_worst
    rs = m.coll("reduce_scatter", grad_bytes, dpcp, dp_cross)
    ag = m.coll("allgather", grad_bytes, dpcp, dp_cross)
    if lay.zero == 1:                          # one reduce-scatter per step, one allgather after it
        dp_t = rs + ag
    elif lay.zero == 2:                        # a reduce-scatter per micro-batch
        dp_t = lay.n_micro * rs + ag
    elif lay.zero == 3:                        # per micro-batch: gathers for forward and backward
        dp_t = lay.n_micro * (rs + 2 * ag)
    else:
        dp_t = m.coll("allreduce", grad_bytes, dpcp, dp_cross)
    dp_exposed = dp_t * (1 - m.overlap)
    opt_t = slow * m.opt_per_param * n_par_worst / (dpcp if lay.zero else 1)
    step = pipe + dp_exposed + opt_t
    time = {"compute": comp * lay.n_micro, "tp_comm": tp_t * lay.n_micro, "ep_comm": ep_t * lay.n_micro,
            "pp_comm": pp_t * lay.n_micro if lay.pp > 1 else 0.0, "cp_comm": cp_t * lay.n_micro,
            "bubble": pipe - busy,
            "dp_comm": dp_exposed, "optimizer": opt_t, "oversubscription": slow}
    return Prediction(lay, mem, time, step, (pipe - busy) / pipe if pipe else 0.0, inflight)


def enumerate_layouts(cfg: GPTConfig, world: int, global_batch: int, ranks_per_node: int,
                      max_micro: int = 64):
    """Yield (Layout, None) for valid layouts and (Layout-or-dict, reason) for rejected ones."""
    for tp in divisors(world):
        try:
            validate_tp(cfg, tp)
        except ValueError as e:
            yield {"tp": tp}, f"invalid: {e}"
            continue
        if tp > ranks_per_node:
            yield {"tp": tp}, f"tp={tp} spans nodes of {ranks_per_node} ranks (tensor parallelism stays in a node)"
            continue
        for cp, pp in ((c, p) for c in divisors(world // tp) for p in divisors(world // (tp * c))):
            dp = world // (tp * cp * pp)
            if cp > 1:
                try:
                    validate_cp(cfg, cp)
                except ValueError as e:
                    yield {"tp": tp, "cp": cp}, f"invalid: {e}"
                    continue
            if global_batch % dp:
                yield {"tp": tp, "cp": cp, "pp": pp, "dp": dp}, f"global batch {global_batch} not divisible by dp={dp}"
                continue
            # experts: ep over the dp x cp ranks with etp = tp, or folded apart (etp < tp) over tp's too
            eps = [(e, None if etp == tp else etp) for etp in divisors(tp)[::-1]
                   for e in divisors(dp * cp * tp // etp) if cfg.n_expert % e == 0] if cfg.n_expert else [(1, None)]
            per_dp = global_batch // dp
            for ep, etp in eps:
                for mbs in divisors(per_dp):
                    nm = per_dp // mbs
                    if nm > max_micro:
                        continue
                    scheds = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)]
                    if pp > 1 and cfg.n_layer % (pp * 2) == 0:
                        scheds.append(("interleaved", 2))
                    if pp > 1 and cfg.n_layer >= 2 * pp:
                        scheds.append(("zb-v", 2))
                        if nm >= 2 * pp:
                            scheds.append(("dualpipev", 2))
                    for sched, v in scheds:
                        lay0 = Layout(dp=dp, pp=pp, tp=tp, ep=ep, cp=cp, micro_batch_size=mbs, n_micro=nm, schedule=sched,
                                      virtual_stages=v, etp=etp)
                        try:
                            validate_pipeline(cfg, pp, nm, sched, v)
                        except ValueError as e:
                            yield lay0, f"invalid: {e}"
                            continue
                        for zero in ([0, 1, 2, 3] if dp * cp > 1 else [0]):
                            sps = [False, True] if tp > 1 and (cfg.block_size // cp) % tp == 0 else [False]
                            for sp, (cc, a2a) in itertools.product(sps, cp_comms(cfg, cp, tp)):
                                base = replace(lay0, zero=zero, seq_parallel=sp, cp_comm=cc, cp_a2a=a2a)
                                try:                  # once: recomputation changes no rule but its name
                                    check(cfg, base)
                                    why = None
                                except ValueError as e:
                                    why = f"invalid: {e}"
                                for rc in RECOMPUTE:
                                    yield replace(base, recompute=rc), why


def plan(cfg: GPTConfig, world: int, global_batch: int, machine: Machine, progress=None):
    """-> (sorted list of Prediction that fit, list of (layout key, reason) rejected).
    ``progress()``, if given, is called once per layout examined (a bar's update)."""
    ok, rejected = [], []
    for lay, reason in enumerate_layouts(cfg, world, global_batch, machine.ranks_per_node):
        if progress is not None:
            progress()
        if reason:
            rejected.append((lay.key() if isinstance(lay, Layout) else str(lay), reason))
            continue
        p = predict(cfg, lay, machine)
        if p.memory["total"] > machine.mem:
            rejected.append((lay.key(), f"out of memory: {p.memory['total'] / GiB:.2f} GiB > "
                                        f"{machine.mem / GiB:.2f} GiB per rank"))
            continue
        ok.append(p)
    ok.sort(key=lambda p: (p.step_time, p.memory["total"]))
    return ok, rejected



def fixed_machine(world: int, ranks_per_node: int | None = None, mem_per_rank: int | None = None) -> Machine:
    """The machine ``choose`` ranks for (see there): constants, nothing measured."""
    rpn = ranks_per_node or world
    d = CPU_DEFAULT
    return Machine(peak=1e10, alpha=d["alpha"], intra_bw=d["intra_bw"], inter_bw=d["inter_bw"],
                   mem=mem_per_rank or 24 * GiB // max(1, rpn), act_bytes=d["act_bytes"], mfu=MFU_ASSUMED["cpu"],
                   ranks_per_node=rpn, overlap=0.0, overhead=d["overhead"], cores=os.cpu_count() or 1)


def choose(cfg: GPTConfig, world: int, global_batch: int, ranks_per_node: int | None = None,
           mem_per_rank: int | None = None, accept=None) -> Layout:
    """The planner's best layout, for ``python -m pympar.train --layout auto``.

    Fixed machine constants (no measurement: CPU_DEFAULT, fitted to the 2-core development VM,
    a 1e10 FLOP/s peak, no process baseline, memory 24 GiB / ranks per node unless given), so
    every rank computes the same answer without communicating; the ranking is that machine's.
    ``python -m pympar.plan --calibration FILE`` (bench/plan_calibrate.py) ranks with this
    machine's measured constants instead. ``accept(layout)`` may raise ValueError to skip layouts the
    run cannot use (beyond ``check``, which every candidate has passed)."""
    preds, rejected = plan(cfg, world, global_batch, fixed_machine(world, ranks_per_node, mem_per_rank))
    for p in preds:
        try:
            if accept is not None:
                accept(p.layout)
        except ValueError as e:
            rejected.append((p.layout.key(), str(e)))
            continue
        return p.layout
    reasons = sorted({r for _, r in rejected})[:3]
    raise ValueError(f"no valid layout of {world} ranks for this model and global batch {global_batch}: {reasons}")
