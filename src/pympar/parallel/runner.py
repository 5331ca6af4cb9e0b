"""The seam between the trainer and the parallel strategies: one ``ParallelRunner`` for any
layout dp x pp x tp with ep | dp.

``build_runner(model_cfg, layout, comm, opts, optim, rec)`` returns it (layout: a pympar.layout.Layout,
optim: a pympar.optim.OptimConfig);
the trainer only ever calls

    runner.train_step(micro_batches, lr, stop) -> StepStats (parallel/stepstats.py: loss, grad_norm,
                                                  loss_scale, skipped, moe, memory, time_split, stop, ...)
    runner.eval_loss(batches)             -> float, the mean loss over the batches of all DP ranks
    runner.generate(prompt, n, top_k, rng) -> (1, T+n) tokens on world rank 0, None elsewhere
    runner.n_params, runner.model_cfg, runner.mesh

``micro_batches`` is this rank's list of (idx (B,T), targets (B,T)): the global micro-batches
g = dp_rank*n_micro + j (pympar.data); every rank of a tp group, of a pipeline and of a cp group
gets the same list (whole sequences: with cp > 1 the runner keeps its rank's positions of each,
parallel.cp). The step's loss is the mean over all micro-batches of the global batch, so every
layout computes the single-process step (docs/design.md, Determinism).

Composition, per rank with mesh coordinates (pp stage, dp rank, tp rank, ep rank):
  model     parallel.build.parallelize (shared with generation), its steps in order: tp's parts,
            pp > 1: this stage's chunks of them (parallel.pp.PipelineGPT) and the schedule's
            PipelineExecutor, else one nn.GPT (tp > 1: parallel.tp.TPGPT); ep > 1: this ep rank's
            experts (alltoallv dispatch); cp > 1: ring or Ulysses attention over this rank's
            positions, MoE routing over the micro-batch; recomputation
  backward  pp = 1: loss_and_grad per micro-batch (grad_scale = loss_scale / n_micro);
            pp > 1: the executor's schedule, which also sums the tied wte between the first
            and last stage and the sequence-parallel partial grads over tp
  sync      GradSync (one gradient path, from each parameter's placement): dense grads mean over
            dp x cp, expert grads over edp x 1/ep
            (buckets, overlap, ZeRO-1/2/3, compression from parallel.dp); under a pipeline the
            buckets of a chunk start once its last micro-batch's backward is done
  norm      every rank counts the gradient elements it owns; ONE world allreduce of a StepShare
            (loss, non-finite count, norm^2, MoE loads, stop requests, memory) per step gives the
            single-process loss and norm, and every MoE layer's global load (for expert-bias
            balancing and rank 0's metrics)
"""
from __future__ import annotations

import math
import time

import numpy as np

from ..backend import to_numpy
from ..comm.exact import ExactSum
from ..comm.objects import gather_object
from ..nn import GPT
from ..nn.gpt import count_params
from ..nn.layers import TokenEmbedding
from ..nn.products import compute_copies
from ..optim import DynamicLossScaler
from .cp import local_batch
from .build import parallelize
from .replicas import place_replicas, valid_copies
from .ep import NodeRouteError
from . import ledger
from .gradsync import GradSync
from .recorder import Recorder
from .ledger import memory_summary
from .mesh import Mesh
from .placement import param_placement
from .meter import Meter, seconds
from .pp.schedules import SPLIT_BACKWARD, measured_costs
from .shard import shard_of
from .stepstats import MoeShare, StepShare, StepStats


def build_runner(model_cfg, layout, comm, opts, optim, rec=None):
    """The Runner for this layout (see the module docstring); comm is the world communicator.
    The layout has passed ``pympar.layout.check`` (the trainer's configuration does it on every
    rank before any communication)."""
    return ParallelRunner(model_cfg, layout, comm, opts, optim, rec)


class ParallelRunner:
    """Builds this rank's part of the model for (pp stage, tp rank, ep rank) and trains it.

    layout: a ``pympar.layout.Layout`` that passed ``pympar.layout.check`` (mesh sizes, schedule,
    virtual stages, micro-batches, ZeRO, sequence parallelism, recomputation); optim: the
    ``pympar.optim.OptimConfig`` (lr, weight_decay, grad_clip, moments_dtype); opts: the run's
    other settings, the trainer's RunConfig (or any object with the fields read here: seed, dtype,
    master_dtype, device, compress, topk_ratio, bucket_mb, dp_overlap, pp_channels, pp_costs, pp_overlap,
    ep_dispatch, expert_replicas, replan_every, deterministic)."""

    pp_overlap, pp_overlap_why = False, ""     # DualPipeV's pairs interleaved, and why (set with a pipeline)

    def __init__(self, model_cfg, layout, comm, opts, optim, rec=None):
        self.model_cfg, self.layout, self.comm = model_cfg, layout, comm
        self.rec = Recorder() if rec is None else rec      # the trainer passes its own (events, trace)
        self.cp = layout.cp
        self.mesh = mesh = Mesh(comm, dp=layout.dp, pp=layout.pp, tp=layout.tp, ep=layout.ep, cp=self.cp,
                                etp=layout.etp)
        self.dp, self.pp, self.tp, self.ep = layout.dp, layout.pp, layout.tp, layout.ep
        self.seed = opts.seed
        self.master = np.dtype(opts.master_dtype)
        self.compute = None if opts.dtype == "float32" else opts.dtype
        self.moments_dtype = optim.moments_dtype
        self.recompute, self.sp, self.zero = layout.recompute, bool(layout.seq_parallel), int(layout.zero)
        self.schedule, self.v, self.bucket_mb = layout.schedule, layout.virtual_stages, opts.bucket_mb
        # --deterministic: every sequence's gradient is a term of exact sums (comm/exact.py), so the
        # step's bits do not depend on dp, the micro-batches or ZeRO (pympar.layout.check refuses
        # what it cannot make so: tp, cp, pp, ep, compression)
        self.deterministic = bool(getattr(opts, "deterministic", False))
        self.meter = Meter()          # the tp collectives, the cp ring and the expert all-to-alls report here
        # --expert-replicas: replica slots per ep rank, placed every replan_every steps (parallel/replicas.py)
        self.replicas, self.replan_every = int(opts.expert_replicas), int(opts.replan_every)
        self._rep_window, self._rep_steps, self._rep_copies = {}, 0, {}
        self.model, self.executor = self._build_model(opts)    # ep > 1: this rank's experts only
        self.pp_costs = opts.pp_costs     # "measured": the zb table is built for step 1's times
        self.device = opts.device
        self.cp_positions = self.model.cp_positions if self.cp > 1 else None   # this rank's positions
        # nothing is allocated yet (parameters are made on first use): ZeRO-3 makes only its rows,
        # on the device; otherwise the model is made on the host (same numbers) and moved
        if self.device != "cpu" and self.zero != 3:
            self.model.to(self.device)
        self.named = named = list(self.model.named_parameters())
        self.params = [p for _, p in named]
        compress = f"topk:{opts.topk_ratio}" if opts.compress == "topk" else opts.compress
        pieces = self._pieces()
        names = {id(p): n for n, p in named}
        units = []                       # ZeRO-3's buckets: a piece each; the embedding's wte and wpe
        for m in pieces:                 # apart (the head's use and gradient of wte come alone)
            own = [names[id(p)] for p in m.parameters() if id(p) in names]
            units += [[n] for n in own] if isinstance(m, TokenEmbedding) else [own]
        units += [[names[id(p)]] for p in self.params if param_placement(p).tied_copy]   # the last stage's wte copy
        self.sync = GradSync(named, mesh, bucket_mb=opts.bucket_mb,
                             overlap=opts.dp_overlap,
                             compress=None if compress in (None, "none") else compress,
                             zero=self.zero, units=units, device=self.device,
                             exact=self.deterministic).attach(self.model)
        if self.zero == 3 and self.device != "cpu":    # the rows are on the device already
            for top in self.model.modules():
                for m in top.modules():
                    m.move_buffers(self.device)
        if self.executor is not None:     # buckets start as each chunk's last backward ends
            self.executor.final_backward_hooks.append(self.sync.begin_final)
            if self.deterministic:        # every B and W action's gradients become exact terms
                self.executor.action_done_hooks.append(self.sync.add_micro)
                self.executor.exact_tied = self.sync.exact_sum_of
        self.opt = self.sync.make_optimizer(lr=optim.lr, weight_decay=optim.weight_decay,
                                            moments_dtype=optim.moments_dtype)
        self.grad_clip = optim.grad_clip
        self.scaler = DynamicLossScaler() if opts.dtype == "float16" else None
        self.moe_ids = [i for i in range(model_cfg.n_layer) if model_cfg.is_moe_block(i)]
        self.n_params = count_params(model_cfg)
        self.ledger, self._workspace = None, None

    def _pieces(self):
        """This rank's model pieces (embedding, blocks, head) in forward order."""
        if self.executor is not None:
            return [m for ch in self.model.chunks for m in ch.pieces()]
        return self.model.pieces()

    def _build_model(self, opts):
        """(model, pipeline executor or None): pympar.parallel.build's model, and the executor of
        the layout's schedule when pp > 1. A layout the ranks' nodes cannot run (--ep-dispatch node
        on one node) fails on every rank alike (NodeRouteError), after one allreduce."""
        err = None
        try:
            model = parallelize(self.model_cfg, self.mesh, self.layout, seed=self.seed, dtype=self.master,
                                compute_dtype=self.compute, sequence_parallel=self.sp, meter=self.meter,
                                ep_dispatch="flat" if (self.replicas or opts.device != "cpu") and opts.ep_dispatch == "auto"
                                else opts.ep_dispatch)
        except NodeRouteError as e:           # agreed inside its ep group; the job agrees below
            err = e
        if opts.ep_dispatch == "node" and self.layout.ep > 1:
            bad = self.comm.allreduce(np.array([0 if err is None else 1], np.int64), op="max")  # host
            if int(np.asarray(bad).reshape(-1)[0]):  # host
                raise NodeRouteError(str(err or NodeRouteError.MESSAGE))
        elif err is not None:
            raise err
        if self.pp == 1:
            return model, None
        from .pp import PipelineExecutor
        channels = {"auto": None, "tags": False, "ordered": True}[opts.pp_channels]
        self.pp_overlap, self.pp_overlap_why = self._pp_overlap(getattr(opts, "pp_overlap", "auto"), opts.device)
        return model, PipelineExecutor(model, self.mesh.pp_comm, self.schedule, channels=channels,
                                       overlap=self.pp_overlap)

    def _pp_overlap(self, mode: str, device: str) -> tuple:
        """--pp-overlap made concrete, the same on every rank, and why (for the start-up line):
        dualpipev's F & B pairs interleave when asked ("on"), or ("auto") on the CPU where some ep
        group's all-to-alls cross nodes (flat, or the node-aware route's hops; inside a node the
        library moves the bytes with the CPU: docs/pipeline.md). auto's answer is the job's (one
        allreduce): the collectives inside a pair start in the pair's order, so every rank that
        shares a group must interleave alike."""
        if self.schedule != "dualpipev" or mode == "off":
            return False, ""
        if mode == "on":
            return True, ""
        ep = self.mesh.ep_comm                  # (its topology: collective over the ep group, asked by all)
        crosses = device == "cpu" and ep.size > 1 and hasattr(ep, "topology") and not ep.topology().single_node
        on = bool(np.asarray(self.comm.allreduce(np.array([int(crosses)], np.int64), op="max")).reshape(-1)[0])  # host
        why = ("an ep group's all-to-alls cross nodes" if on else "no expert all-to-all" if ep.size == 1 else
               "not on GPUs" if device != "cpu" else "the ep groups' all-to-alls stay inside a node")
        return on, why

    def _local(self, batches):
        """This rank's positions of each (idx, targets) of whole sequences (all of them when cp = 1)."""
        if self.cp_positions is None:
            return batches
        T = self.model_cfg.block_size
        for idx, _ in batches:
            if np.shape(idx)[1] != T:
                raise ValueError(f"context parallelism splits sequences of block_size={T} positions; got a batch of "
                                 f"{np.shape(idx)[1]}: pass whole sequences of {T}")
        return [local_batch(b, self.cp_positions) for b in batches]

    def _allreduce(self, v):
        """Sum of a host float64 vector over the world (MPI side of a DeviceComm)."""
        if self.comm.size == 1:
            return v
        out = self.comm.allreduce(v)
        return v if out is None else np.asarray(out)  # host

    # --- one optimizer step ------------------------------------------------------------------
    def train_step(self, micro_batches, lr, stop=False, written=False) -> StepStats:
        """One optimizer step: forward and backward of every micro-batch, the gradients' sync,
        the step's one world allreduce, the update. Two flags ride on the allreduce: ``stop`` (this
        rank was asked to stop, a signal) -> ``stats.stop`` on every rank when any rank was;
        ``written`` (this rank's part of a background checkpoint is on disk) -> ``stats.all_written``
        when every rank's is."""
        scale = self.scaler.scale if self.scaler else 1.0
        self.meter.take()                                 # eval/generation since the last step
        self.model.zero_grad()
        self.sync.begin_step()
        work = self._forward_backward(self._local(micro_batches), scale)
        moe, a2a = self._comm_times(work)
        # communication wherever a group spans ranks: the dense one dp x cp, the experts' edp (folded: also at dp = 1)
        sync = "dp_comm" if any(d.comm.size > 1 for d in self.sync.syncs) else "optimizer"
        with self.rec.span("grad sync", sync, bytes=self.sync.grad_bytes):
            self.sync.finish()
        self._update_ledger(work["micro_batches"], work["act"], work["recv_bytes"])
        share = self._share(work, moe, a2a, stop, written)
        slots = share.slots()                     # the vector's layout, derived once a step
        with self.rec.span("step allreduce", self._world_comm_category(), bytes=8 * slots.size):
            total = share.unpack(self._allreduce(share.pack(slots)), slots)
        stats = self._stats(total, work, scale)
        with self.rec.span("optimizer", "optimizer"):
            self._update(stats, total, lr, scale)
        stats.time_split = self.rec.take_totals()
        return stats

    def _forward_backward(self, micro_batches, scale) -> dict:
        """Every micro-batch's forward and backward (the pipeline's schedule when pp > 1): this
        rank's loss and the step's compute, bubble and buffer figures."""
        rec, sync, model, n = self.rec, self.sync, self.model, len(micro_batches)
        t0 = time.perf_counter()
        work = dict(micro_batches=micro_batches, t0=t0, pipe={}, bubble=0.0, pp_other=0.0, recv_bytes=0)
        with compute_copies():                            # each weight cast to the compute dtype once a step
            if self.executor is not None:
                sync.begin_micro(last=False)              # the executor calls sync.begin_final per chunk
                trace = (lambda label, t, dt, mb: rec.add(label, "layer", t, dt, mb=mb)) if rec.enabled else None
                if self.deterministic:                    # one sequence a micro-batch, scaled by 1/G
                    seqs = self._sequences(micro_batches)
                    g = len(seqs) * self.dp
                    pipe = self.executor.train_step(seqs, loss_scale=scale, trace=trace, grad_scale=scale / g)
                    self._exact_loss = self._loss_terms(pipe["losses"], g)
                else:
                    pipe = self.executor.train_step(micro_batches, loss_scale=scale, trace=trace)
                work.update(loss=pipe["loss"], compute=pipe["compute_s"], pipe=pipe, bubble=pipe["recv_wait_s"],
                            pp_other=max(pipe["step_s"] - pipe["compute_s"] - pipe["recv_wait_s"], 0.0),
                            act=pipe["activation_peak_bytes"], recv_bytes=pipe["recv_buffer_bytes"])
                return work
            if self.deterministic:
                loss, stats = self._exact_micro_batches(micro_batches, scale, rec)
            else:
                loss, stats = 0.0, {}
                for j, (idx, targets) in enumerate(micro_batches):
                    sync.begin_micro(last=(j == n - 1))
                    tm = time.perf_counter()
                    trace = (lambda label, j=j: rec.span(label, "layer", mb=j)) if rec.enabled else None
                    loss += model.loss_and_grad(idx, targets, grad_scale=scale / n, stats=stats, trace=trace) / n
                    rec.add(f"micro-batch {j}", "micro", tm, time.perf_counter() - tm, mb=j)
        work.update(loss=loss, compute=time.perf_counter() - t0, act=stats.get("activation_bytes", 0))
        return work

    def _comm_times(self, work):
        """The step's communication as the meter measured it, into the profile's categories;
        returns (this rank's MoE statistics by layer, its all-to-all times by layer)."""
        rec, t0 = self.rec, work["t0"]
        measured = self.meter.take()                      # this step's communication, by part
        tp_s = seconds(measured, "tp")
        local_moe = {st["layer"]: st for st in self.model.moe_stats()}
        if self.ep > 1:                   # the rows each ep rank's experts ran (replicas included)
            for i, m in self.model.moe_layers():
                local_moe[i]["rank_rows"] = m.expert_parallel.take_stats()["rank_rows"]
        a2a = {k[1]: t for k, t in measured.items() if k[0] == "ep"}   # this rank's: summed by the step vector
        ep_s = sum(t.seconds for t in a2a.values())
        cp_s, cp_busy = seconds(measured, "cp wait"), seconds(measured, "cp compute")
        work["cp_ring"] = dict(wait_s=cp_s, busy_s=cp_busy)
        rec.add("forward/backward", "compute", t0, max(work["compute"] - tp_s - ep_s - cp_s, 0.0))
        rec.add("tp collectives", "tp_comm", t0, tp_s)
        rec.add("context-parallel ring", "cp_comm", t0, cp_s)
        rec.add("expert all-to-all", "ep_comm", t0, ep_s)
        rec.add("pipeline wait", "bubble", t0, work["bubble"])
        rec.add("pipeline send/tied/loss", "pp_comm", t0, work["pp_other"])
        return local_moe, a2a

    def _measuring(self):
        """--pp-costs measured, before the table is built: step 1's F, B, W times ride on the step vector."""
        return self.executor is not None and self.pp_costs == "measured" and self.schedule in SPLIT_BACKWARD \
            and self.executor.costs is None

    def _share(self, work, local_moe, a2a, stop, written) -> StepShare:
        """This rank's part of the step's world sum (parallel/stepstats.py): each figure is written
        by the ranks that own it, so the world's sum is the figure."""
        m = self.mesh
        share = StepShare(nonfinite=self.sync.nonfinite(), norm_sq=self.sync.local_sq(), stop=float(bool(stop)),
                          written=float(bool(written)),
                          moe={i: MoeShare.zeros(self.model_cfg.n_expert, self.ep) for i in self.moe_ids},
                          memory=ledger.memory_vector(self.comm.size, self.comm.rank, self.ledger["peak"]))
        if m.tp_rank == 0 and m.pp_rank == 0:              # the loss is the same over tp and pp
            share.loss = work["loss"]
        for i, st in local_moe.items():
            sh = share.moe[i]
            if m.tp_rank == 0:                             # routing is replicated over tp
                sh.load[:] = st["tokens_per_expert"]
                sh.dropped = st["dropped_fraction"]
            if m.etp_rank == 0:                            # the experts' side: each share of the rows (folded) counts
                if i in a2a:                               # the world sum: the mean over the senders, the bytes' sum
                    sh.a2a_s = a2a[i].seconds / (self.dp * self.cp * m.fold)
                    sh.a2a_bytes = a2a[i].bytes
                if "rank_rows" in st:                      # summed over the ep groups
                    sh.rows[m.ep_rank] = st["rank_rows"]
        # --pp-costs measured: step 1's F, B, W times of every stage, from one replica (dp, cp, tp
        # rank 0), so each slot has one contributor and the sum is exact: every rank of the job
        # then builds the same table (their pipelines' collectives must match)
        if self._measuring():
            times = work["pipe"]["stage_times"]
            share.stage_times = times if m.dp_rank == 0 and m.cp_rank == 0 and m.tp_rank == 0 else np.zeros_like(times)  # host
        return share

    def _stats(self, total: StepShare, work, scale) -> StepStats:
        """The step's figures from the world's sum (the same on every rank)."""
        loss = total.loss / (self.dp * self.cp)
        if self.deterministic:            # the loss as an exact sum over the world too
            loss = float(self._exact_loss.allreduce(self.mesh.dpcp_comm).value())
        nonfinite = total.nonfinite > 0 or not math.isfinite(loss)
        return StepStats(loss=loss, grad_norm=float("nan"), loss_scale=scale, skipped=nonfinite, nonfinite=nonfinite,
                         stop=total.stop > 0, all_written=total.written >= self.comm.size,
                         moe=[total.moe[i].summary(i, self.dp * self.cp, self.ep) for i in self.moe_ids],
                         memory=memory_summary(total.memory, self.comm.size), cp_ring=work["cp_ring"],
                         pipeline={k: work["pipe"][k] for k in ("bubble", "peak_in_flight", "table_costs")
                                   if k in work["pipe"]})

    def _update(self, stats: StepStats, total: StepShare, lr, scale):
        """The optimizer step, unless a non-finite loss or gradient (agreed: the world's sum) skips
        it; float16 also moves the loss scale. Sets stats.skipped and stats.grad_norm."""
        if self._measuring():
            self.executor.costs = measured_costs(total.stage_times)
        total_sq = self.sync.exact_sq(self.comm) if self.deterministic else total.norm_sq
        if self.scaler:
            stats.skipped = self.scaler.update(stats.nonfinite)
            self.sync.scale_grads(1.0 / scale)
            total_sq /= scale * scale
        if stats.skipped:
            return
        stats.grad_norm = self.sync.step(self.opt, lr, self.grad_clip, total_sq)
        # aux-loss-free balancing must see the global loads, or replicas drift apart
        self.model.update_expert_bias({i: stats.moe[self.moe_ids.index(i)]["tokens_per_expert"]
                                       for i, _ in self.model.moe_layers()})
        self._replicas_after_step(self.model, stats.moe)

    @staticmethod
    def _sequences(micro_batches):
        """--deterministic's micro-batches: one sequence each, in order."""
        return [(idx[i:i + 1], tg[i:i + 1]) for idx, tg in micro_batches for i in range(len(idx))]

    def _exact_micro_batches(self, micro_batches, scale, rec):
        """--deterministic: one sequence at a time, each sequence's gradient scaled by 1 / (the
        global batch's sequences) and added exactly (GradSync.add_micro), its loss likewise: the
        terms are then the same for any dp and any split into micro-batches, and so are their sums."""
        seqs = self._sequences(micro_batches)
        g = len(seqs) * self.dp                           # every dp rank holds as many
        parts, stats = [], {}
        for j, (idx, targets) in enumerate(seqs):
            self.sync.begin_micro(last=j == len(seqs) - 1)
            tm = time.perf_counter()
            parts.append(self.model.loss_and_grad(idx, targets, grad_scale=scale / g, stats=stats))
            self.sync.add_micro()
            rec.add(f"sequence {j}", "micro", tm, time.perf_counter() - tm, mb=j)
        self._exact_loss = self._loss_terms(parts, g)
        return sum(parts) / len(parts), stats           # (the step vector's slot; the loss is the exact sum's)

    @staticmethod
    def _loss_terms(parts, g):
        """The step's per-sequence losses over g as the terms of one exact sum (reduced over dp later)."""
        acc = ExactSum((), np.float64)
        for part in parts:
            acc.add(np.float64(part) / g)
        return acc

    # --- the memory ledger --------------------------------------------------------------------
    def _update_ledger(self, micro_batches, act, recv_bytes):
        """This rank's ledger after a step: what it holds, and the step's activation and
        communication peaks (the largest seen so far)."""
        comm = sum(d.peak_inflight_bytes for d in self.sync.syncs) + recv_bytes
        transient = sum(d.peak_full_grad_bytes for d in self.sync.syncs)
        if self.zero == 3:
            comm += self.sync.gather.peak_gathered_bytes
        if self.cp > 1:                    # one attention's buffers at a time: the largest
            comm += max((c.peak_bytes for c in self.model.cp_cores), default=0)
        if self._workspace is None:
            B, T = np.shape(micro_batches[0][0])
            blocks, first, last = self._held_blocks()
            item = np.dtype(self.compute or self.master).itemsize
            self._workspace = ledger.workspace_bytes(
                self.model_cfg, B, T, self.tp, self.recompute, blocks, last, item, self.master.itemsize,
                deferred_w=self.pp > 1 and self.schedule in SPLIT_BACKWARD,
                gather=ledger.ulysses_span(self.cp, self.layout.cp_comm, self.layout.cp_a2a))
        old = self.ledger or {}
        self.ledger = ledger.measure(self.sync, self.opt, self.params, max(act, old.get("activations", 0)),
                                     max(comm, old.get("communication", 0)), self._workspace, transient)

    def held(self) -> dict:
        """What this rank holds between steps: parameters, gradient storage, optimizer state."""
        led = ledger.measure(self.sync, self.opt, self.params, 0, 0, 0)
        return {k: led[k] for k in ("parameters", "gradients", "optimizer")}

    def _held_blocks(self):
        """(block indices, first stage?, last stage?) of this rank."""
        if self.executor is None:
            return list(range(self.model_cfg.n_layer)), True, True
        ch = self.model.chunks
        return [i for c in ch for i in c.block_ids], any(c.embedding is not None for c in ch), \
            any(c.head is not None for c in ch)

    def _world_comm_category(self):
        """The time-split key of a world collective: the largest kind of group it spans."""
        for key, size in (("dp_comm", self.dp), ("pp_comm", self.pp), ("cp_comm", self.cp), ("tp_comm", self.tp)):
            if size > 1:
                return key
        return "optimizer"

    def _replicas_after_step(self, model, moe):
        """--expert-replicas: every --replan-every steps each MoE layer's replicas are placed anew
        from the window's global loads (the same numbers on every rank: the world allreduce's; every
        rank places every layer's, so rank 0's state is the job's), and after every optimizer step
        the replicas take their homes' new weights. Collective over ep."""
        if not self.replicas:
            return
        for k, i in enumerate(self.moe_ids):
            load = np.asarray(moe[k]["tokens_per_expert"], np.float64)  # host
            self._rep_window[i] = self._rep_window.get(i, 0) + load
        self._rep_steps += 1
        if self._rep_steps % self.replan_every == 0:
            self._rep_copies = {i: place_replicas(self._rep_window.pop(i), self.ep, self.replicas)
                                for i in self.moe_ids}
            for i, m in model.moe_layers():
                m.expert_parallel.set_replicas(self._rep_copies[i])
        else:
            for _, m in model.moe_layers():
                m.expert_parallel.refresh_replicas()

    def replica_state(self):
        """What a checkpoint keeps of the replicas (JSON; the same on every rank): the steps counted,
        the loads of the open window, the placement in use."""
        if not self.replicas:
            return None
        window = {str(i): np.asarray(w).tolist() for i, w in self._rep_window.items()}  # host: the step allreduce's
        return dict(steps=self._rep_steps, window=window, copies={str(i): c for i, c in self._rep_copies.items()})

    def load_replica_state(self, state):
        """Collective over ep: the replicas as a checkpoint left them, so a resumed run places and
        refreshes them as the uninterrupted run does. A state that does not fit this run (another
        ep or slot count: an elastic restart, a file from elsewhere) is dropped: the run starts
        without replicas and places them after --replan-every steps (every rank decides alike: the
        same file)."""
        if not self.replicas or not state:
            return
        E = self.model_cfg.n_expert
        try:
            steps = state["steps"]
            window = {int(k): np.asarray(v, np.float64) for k, v in state["window"].items()}  # host
            copies = {int(k): [[int(r) for r in c] for c in v] for k, v in state["copies"].items()}
            ok = (isinstance(steps, int) and steps >= 0 and set(copies) <= set(self.moe_ids)
                  and set(window) <= set(self.moe_ids) and all(w.shape == (E,) for w in window.values())
                  and all(valid_copies(c, E, self.ep, self.replicas) for c in copies.values()))
        except (KeyError, TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            return
        self._rep_steps, self._rep_window, self._rep_copies = steps, window, copies
        for i, m in self.model.moe_layers():
            if i in copies:
                m.expert_parallel.set_replicas(copies[i])

    # --- evaluation and sampling ---------------------------------------------------------------
    def eval_loss(self, batches) -> float:
        """Mean forward loss over this rank's batches and those of the other DP ranks.

        Every rank of a dp group runs the same number of forward passes (the most any has;
        padding passes are discarded): MoE layers exchange tokens over ep, stages over pp."""
        batches = self._local(batches)
        group = self.mesh.dpcp_comm                  # every cp rank holds a mean over its positions
        with self.rec.span("eval", "eval", n=len(batches)):
            n_max = len(batches)
            if group.size > 1:
                n_max = int(np.asarray(group.allreduce(np.array([n_max], np.int64), op="max")).reshape(-1)[0])  # host
            T = self.model_cfg.block_size
            pad = batches[0] if batches else self._local([(np.zeros((1, T), np.int64), np.zeros((1, T), np.int64))])[0]  # host tokens
            total = 0.0
            with compute_copies():
                for j in range(n_max):
                    x, y = batches[j] if j < len(batches) else pad
                    if self.executor is not None:
                        loss = self.executor.forward_loss([(x, y)])
                    else:
                        loss = self.model.forward_loss(x, y)
                    total += loss if j < len(batches) else 0.0
            local = np.array([total, len(batches)], np.float64)  # host
            tot = local
            if group.size > 1:
                out = group.allreduce(local)
                tot = local if out is None else np.asarray(out)  # host
        return float(tot[0] / max(tot[1], 1))

    def generate(self, prompt, n, top_k, rng):
        """Sample on world rank 0. A layout that splits the model first gathers the full
        parameters there (one gather); the other ranks return None without further collectives."""
        if self.pp == self.tp == self.ep == self.cp == 1 and self.zero != 3:
            return self.model.generate(prompt, n, top_k=top_k, rng=rng) if self.comm.rank == 0 else None
        state = self.full_state_dict()
        if state is None:
            return None
        full = GPT(self.model_cfg, seed=self.seed, dtype=self.master, compute_dtype=self.compute)
        full.load_state_dict(state)
        return full.generate(prompt, n, top_k=top_k, rng=rng)

    def full_state_dict(self):
        """Collective over the world: the full nn.GPT state dict on world rank 0, None elsewhere.
        Only the ranks of the first edp replica (together all experts) and of the first dp x cp
        replica (all dense shards) send their pieces, as host copies (under ZeRO-3 every rank: each
        holds its rows)."""
        m = self.mesh
        mine = None
        if m.edp_rank == 0 or m.dpcp_rank == 0 or self.zero == 3:
            mine = [(n, to_numpy(p.data), shard_of(p)) for n, p in self.model.named_parameters()]
            mine += [(f"transformer.h.{i}.moe.expert_bias", to_numpy(layer.expert_bias), None)
                     for i, layer in self.model.moe_layers()]
        pieces = gather_object(self.comm, mine, root=0)   # timed: a missing rank raises, not hangs
        if self.comm.rank != 0:
            return None
        state = {}
        for part in pieces:
            for name, a, sh in part or ():
                if sh is None:
                    state[name] = np.array(a)  # host
                else:
                    full = state.setdefault(name, np.zeros(sh.full_shape, a.dtype))  # host
                    sh.put(full, a)
        return state

    def sharded_state(self):
        """{global name: (local array, Shard or None)} of this rank (checkpoints); the tied wte once."""
        if self.executor is not None:
            return self.model.sharded_state()
        return {n: (p.data, shard_of(p)) for n, p in self.model.named_parameters()}

