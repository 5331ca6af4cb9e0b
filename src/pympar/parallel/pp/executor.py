"""Run one pipeline rank's action list: forward/backward of its chunks, isend/irecv between stages.

Per step (m micro-batches, loss = mean over micro-batches, as single-process accumulation):
  * receives are posted ahead (a window of upcoming actions), so a neighbour's message lands
    while this rank computes; activations and gradients leave by isend, and the send
    requests are only completed at the end of the step;
  * the last stage computes each micro-batch's loss and starts backward with grad_scale
    = loss_scale / m; MoE blocks add their aux/z-loss gradient with the same scale;
  * when a micro-batch's B on the last stage is the action right after its F (1F1B, zb-h1 and
    zb-v's steady state) and the head is chunked (its logits never held whole), F runs the
    head's forward and backward in one pass, so each chunk's logits are computed once, as one
    process computes them (``Head.forward_backward``), instead of again in B;
  * zero-bubble schedules (zb-h1, zb-v, dualpipev): a B action is ``GPT.stage_backward_input`` (the input
    gradient, sent on at once) and keeps the deferred weight gradients (``WeightGrads``) until
    its W action runs them; the chunk's parameters are reported final (grad_ready) after W;
  * after the last action the tied wte/lm_head gradient is summed between the first and last
    rank (pp > 1), and the per-micro-batch losses are summed over the pipeline group, so every
    rank returns the same mean loss;
  * each rank measures its bubble: 1 - (time computing F/B) / (step time up to the loss
    reduction), the time it waited on receives, and its peak micro-batches in flight.

Message tags: each message is named by the receiver's (kind, micro, local chunk), so any order
of arrival matches the right buffer.

Devices: activations, gradients and receive buffers live on the parameters' device (the array
module is taken from the model at each step: ParallelRunner moves the model after building the
executor); micro-batch token arrays arrive on the host and are moved there. The per-micro-batch
losses are host floats. Point-to-point messages go over MPI, tag-matched (a GPU buffer is staged
through the host or handed to a CUDA-aware MPI), or -- when the pipeline communicator has NCCL
-- over ordered two-rank channels without tags (pp/channels.py: NCCL send/recv have no tags
and run in issue order on one stream, so the receives posted ahead here would block the sends
behind them on one shared communicator).
"""
from __future__ import annotations

import time

import numpy as np

from ...backend import held_bytes, xp_of
from .. import overlap
from ..placement import param_placement
from . import channels
from .partition import TIED_TAG, check_tags, validate_pipeline
from .schedules import SPLIT_BACKWARD, Action, build_schedule, overlap_pairs, placement_of, validate_schedule
from .stage import PipelineGPT


class _P2P:
    """The point-to-point and reduction calls the executor needs, over a pympar Communicator
    (isend/irecv -> Request.wait()/test(), allreduce)."""

    def __init__(self, comm, v=None, use_channels=None, placement="interleaved"):
        if hasattr(comm, "Isend"):
            raise TypeError(f"the pipeline runs over a pympar Communicator, not the mpi4py {type(comm).__name__}: "
                            f"wrap it, pympar.comm.MPIComm(comm) (the mesh's pp_comm is one)")
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        # NCCL (or use_channels=True): ordered two-rank channels, no tags (pp/channels.py);
        # otherwise tagged messages, over the MPI side of a DeviceComm that has NCCL
        self.channels = None
        if v is not None and channels.wanted(comm, use_channels):
            self.channels = channels.Channels(comm, v, placement)
        self.p2p = comm.mpi if getattr(comm, "uses_nccl", False) else comm

    def isend(self, buf, dest, tag):
        if self.channels is not None:
            return self.channels.isend(buf, dest, tag)
        return self.p2p.isend(buf, dest, tag=tag)

    def irecv(self, buf, source, tag):
        if self.channels is not None:
            return self.channels.irecv(buf, source, tag)
        return self.p2p.irecv(buf, source, tag=tag)

    def allreduce_sum(self, x):
        """Sum of a host float64 vector (the per-micro-batch losses) over the group."""
        return self.comm.allreduce(x, op="sum")


class PipelineExecutor:
    """Runs ``schedule`` (one of schedules.SCHEDULES) for a PipelineGPT over the pipeline
    communicator ``comm`` (rank i = pipeline stage i; a pympar Communicator).

    ``recv_window``: how many upcoming receives are kept posted ahead of the action that needs
    them (default 2*p*v + 2: more than a 1F1B round trip, without a buffer per micro-batch).
    ``channels``: True, send over ordered two-rank channels (pp/channels.py); False, tagged
    messages; None (default), channels exactly when ``comm`` runs on NCCL.
    ``overlap`` (dualpipev): True, run each of its F & B pairs interleaved, one's expert-parallel
    all-to-alls in flight while the other computes (parallel/overlap.py); False (default): one
    action after the other. Every rank of the job must pass the same (the collectives inside a pair
    start in the pair's order); the trainer's ``--pp-overlap auto`` decides it for the job
    (ParallelRunner: where the ep groups' all-to-alls cross nodes).
    """

    def __init__(self, model, comm, schedule: str = "1f1b", recv_window: int | None = None,
                 channels: bool | None = None, costs: tuple | None = None, overlap: bool = False):
        self.model, self.schedule = model, schedule
        if overlap and schedule != "dualpipev":
            raise ValueError(f"overlap pairs a forward with a backward as DualPipeV's table places them: "
                             f"schedule {schedule!r} has no such pairs (use dualpipev)")
        self.overlap = bool(overlap)
        # the split schedules' table: built for unit times (None) or for (F, B, W) per global
        # stage (schedules.list_schedule); set it between steps -- the same on every rank of the
        # job -- e.g. to measured_costs of the times a step reported (stats["stage_times"])
        self.costs = costs
        self.p2p = _P2P(comm, model.v, channels, model.part.placement)
        if self.p2p.size != model.pp or self.p2p.rank != model.rank:
            raise ValueError(f"pipeline communicator has rank {self.p2p.rank} of {self.p2p.size}, "
                             f"but the model was built for rank {model.rank} of pp={model.pp}")
        validate_schedule(schedule, model.pp, 2 * model.pp, model.v)   # name and v (n_micro is checked per step)
        if model.part.placement != placement_of(schedule):
            raise ValueError(f"schedule {schedule!r} runs chunks placed {placement_of(schedule)!r}, but the model was "
                             f"built {model.part.placement!r}: build it with placement={placement_of(schedule)!r} "
                             f"(build_pipeline does)")
        self.recv_window = recv_window or 2 * model.pp * model.v + 2
        # tensor + sequence parallelism: replicated params with per-tp-rank partial grads
        self.partial_sync = model.make_partial_grad_sync()
        # callbacks h(params) told when the step's last backward of params begins: before the
        # last micro-batch's B of each chunk (its parameters), and after the last action (all of
        # the rank's: the tied wte and partial grads are summed then). A data-parallel sync
        # (DataParallel.begin_final) then starts buckets on the next grad_ready: overlap.
        self.final_backward_hooks = []
        # --deterministic (the runner's): h() after every B and W action (each action's weight
        # gradients become terms of exact sums, GradSync.add_micro), and exact_tied(param) -> the
        # ExactSum of the tied wte, merged between the first and last stage instead of summed in float
        self.action_done_hooks = []
        self.exact_tied = None
        self.stats = {}

    # --- neighbours and tags --------------------------------------------------------------
    def _peer(self, stage):
        return self.model.part.rank_of(stage)[0]

    def _chunk_of(self, stage):
        """The receiving rank's local chunk of global ``stage`` (message tags name it)."""
        return self.model.part.rank_of(stage)[1]

    def _tag(self, kind, micro, chunk, m):
        return ((chunk * m + micro) << 1) | (kind == "B")

    def _needs_recv(self, a: Action):
        s = self.model.chunks[a.chunk].stage
        if a.kind == "W":
            return False, None
        if a.kind == "F":
            return s > 0, s - 1
        return s < self.model.part.n_stage - 1, s + 1

    # --- one training step ----------------------------------------------------------------
    def train_step(self, micro_batches, loss_scale: float = 1.0, trace=None, grad_scale=None) -> dict:
        """Forward and backward of all micro-batches [(idx (B,T), targets (B,T)), ...] on this rank.

        Every rank gets the same list (the first stage reads idx, the last targets). Gradients of
        loss_scale * mean loss accumulate into .grad (call zero_grad before). Returns a dict:
        loss (mean over micro-batches, same on every rank), losses (per micro-batch), bubble,
        recv_wait_s, compute_s (f_s + b_s + w_s: seconds in F, B and W actions; w_s is 0 unless the
        schedule splits the backward), step_s, peak_in_flight, activation_peak_bytes (the most the ctxs in
        flight held at once), recv_buffer_bytes (receive buffers posted at once, at most),
        stage_times (S, 3: this rank's seconds per micro-batch in F, B, W of each global stage it
        holds, zero for the others), table_costs (what this step's table was built for). trace
        (optional): called (label, t0, seconds, micro-batch) after each action ("fwd stage 2",
        "bwd stage 2", "wgrad stage 2"; the runner's profiler records them), once per turn it ran
        for an action of an interleaved pair (--pp-overlap: the two actions' turns alternate)."""
        model, p, v = self.model, self.model.pp, self.model.v
        xp = model.xp                                     # where activations live (after model.to)
        m = len(micro_batches)
        used = self.costs                                  # the table's times (None: unit)
        actions = build_schedule(self.schedule, p, m, v, model.rank, used)
        B, T = np.shape(micro_batches[0][0])
        for j, (idx, targets) in enumerate(micro_batches):
            if np.shape(idx) != (B, T) or np.shape(targets) != (B, T):
                raise ValueError(f"micro-batch {j} has idx {np.shape(idx)}, targets {np.shape(targets)}: every "
                                 f"micro-batch of a pipeline step must be ({B}, {T}) (receive buffers are sized once)")
        act_dtype = model.act_dtype
        shape = model.activation_shape(B, T)
        grad_scale = loss_scale / m if grad_scale is None else grad_scale     # (given: --deterministic's 1/G)
        check_tags(m, v)

        if self.partial_sync is not None:
            self.partial_sync.begin()
        t0 = time.perf_counter()
        recv_wait = 0.0
        S = model.part.n_stage
        by_stage = np.zeros((S, 3), dtype=np.float64)    # host: seconds per (global stage, F/B/W)
        pending = {}                 # (kind, micro, chunk) -> (request, buffer)
        sends = []
        to_post = [a for a in actions if self._needs_recv(a)[0]]
        posted = 0

        def post_upto(k):
            nonlocal posted
            while posted < min(k, len(to_post)):
                a = to_post[posted]
                buf = xp.empty(shape, dtype=act_dtype)
                src = self._peer(self._needs_recv(a)[1])
                pending[(a.kind, a.micro, a.chunk)] = (self.p2p.irecv(buf, src, self._tag(a.kind, a.micro, a.chunk, m)), buf)
                posted += 1

        post_upto(self.recv_window)
        split = self.schedule in SPLIT_BACKWARD          # B is the input gradient, W the weights'
        grads_kind = "W" if split else "B"
        last_b = {a.chunk: i for i, a in enumerate(actions) if a.kind == grads_kind}   # chunk -> its last B (W)
        ctxs, kept, wgrads = {}, {}, {}
        local_terms = np.zeros(m, dtype=np.float64)  # host: per-micro-batch loss terms (floats)
        live = peak = 0
        live_bytes = peak_bytes = 0                  # what the ctxs in flight hold (each buffer once)
        peak_posted = len(pending)
        n_recv_used = n_pairs = 0
        def receive(a):
            """The input ``a`` waits for (None for the first stage's F and for W). In a strand of an
            overlapped pair the wait is a hand-over point (overlap.exchange): the partner computes
            while the message is on its way, and only this strand's own seconds count as waiting."""
            nonlocal recv_wait, n_recv_used, peak_posted
            if not self._needs_recv(a)[0]:
                return None
            req, buf = pending.pop((a.kind, a.micro, a.chunk))
            _, waited = overlap.exchange(req.wait, lambda: req)
            recv_wait += waited
            n_recv_used += 1
            post_upto(n_recv_used + self.recv_window)
            peak_posted = max(peak_posted, len(pending))
            return buf

        def compute(i_act, a, inp, settle=None):
            """Run action ``a`` -> what it sends on (None: nothing). settle (a B in an overlapped
            pair): a list the B's release of its activations goes to, applied after the pair, so the
            counts (peak_in_flight, activation_peak_bytes) are those of the table's order, F then B."""
            nonlocal live, peak, live_bytes, peak_bytes
            chunk = model.chunks[a.chunk]
            if a.kind == "F":
                idx, targets = micro_batches[a.micro]
                x = xp.asarray(idx) if inp is None else inp               # host tokens -> the device
                # the head's B right after its F: the head's backward runs in F's pass (its logits
                # once, not twice); nothing between them, so every gradient is added in the order,
                # and with the notifications, it had (bitwise the same)
                fuse = chunk.head_fuses(B * T) and actions[i_act + 1:i_act + 2] == [Action("B", a.micro, a.chunk)]
                y, ctx, terms = chunk.stage_forward(x, xp.asarray(targets) if chunk.head is not None else None,
                                                    grad_scale if fuse else None)
                ctxs[(a.micro, a.chunk)] = ctx
                kept[(a.micro, a.chunk)] = nb = held_bytes(ctx)
                live_bytes += nb
                peak_bytes = max(peak_bytes, live_bytes)
                local_terms[a.micro] += terms
                live += 1
                peak = max(peak, live)
                return y
            if a.kind == "W":                                 # the weight gradients B deferred
                if last_b[a.chunk] == i_act:
                    self._final_backward([p_ for _, p_ in chunk.named_parameters()])
                w, nb = wgrads.pop((a.micro, a.chunk))
                w.run()
                live_bytes -= nb
                model.notify_chunk_ready(chunk)
                for hook in self.action_done_hooks:
                    hook()
                return None
            if last_b[a.chunk] == i_act:
                self._final_backward([p_ for _, p_ in chunk.named_parameters()])
            ctx = ctxs.pop((a.micro, a.chunk))
            held = kept.pop((a.micro, a.chunk))
            nb = 0
            if split:                                         # what W needs stays alive until W
                out, w = chunk.stage_backward_input(inp, ctx, grad_scale)
                del ctx
                nb = w.nbytes
                wgrads[(a.micro, a.chunk)] = (w, nb)
            else:
                out = chunk.stage_backward(inp, ctx, grad_scale,
                                           ready=model.notify_module_ready if model.grad_ready_hooks else None)
                model.notify_chunk_ready(chunk)
            for hook in self.action_done_hooks:
                hook()

            def release():
                nonlocal live, live_bytes, peak_bytes
                live_bytes += nb - held                       # the ctx let go, W's closures kept
                peak_bytes = max(peak_bytes, live_bytes)
                live -= 1
            if settle is None:
                release()
            else:
                settle.append(release)
            return out

        def count(a, secs, spans):
            """Count ``a``'s seconds and trace it: one event per span (start, seconds) it ran."""
            s = model.chunks[a.chunk].stage
            by_stage[s, "FBW".index(a.kind)] += secs
            if trace is not None:                            # the profiler's events of this action
                for t_start, dt in spans:
                    trace(f"{_KIND_LABEL[a.kind]} stage {s}", t_start, dt, a.micro)

        def send_on(a, out):
            """Send ``a``'s output to the stage that needs it (nothing for None)."""
            nonlocal sends
            if out is not None:
                s = model.chunks[a.chunk].stage
                if out.shape != shape or not np.can_cast(out.dtype, act_dtype, "same_kind") or \
                        out.dtype.itemsize > act_dtype.itemsize:
                    raise ValueError(f"stage {s} produced {a.kind} output {out.shape} {out.dtype}, but stages "
                                     f"exchange {shape} {act_dtype}: the model's dtype/activation_shape is wrong")
                send = xp.ascontiguousarray(out, dtype=act_dtype)
                dest_stage = s + 1 if a.kind == "F" else s - 1
                dest_chunk = self._chunk_of(dest_stage)
                sends.append((self.p2p.isend(send, self._peer(dest_stage), self._tag(a.kind, a.micro, dest_chunk, m)), send))
            # let MPI progress outstanding transfers without blocking
            sends = [(r, b) for r, b in sends if not r.test()]

        pairs = overlap_pairs(actions) if self.overlap else set()
        i_act = 0
        while i_act < len(actions):
            a = actions[i_act]
            if i_act in pairs:                               # DualPipeV's F & B: one's exchanges behind the other
                b = actions[i_act + 1]
                inp_a, settle, turns = receive(a), [], ([], [])
                # B's input awaited in its strand; each output leaves as its strand ends; the
                # trace shows each strand's turns where they ran
                _, _, sa, sb = overlap.interleave(lambda: send_on(a, compute(i_act, a, inp_a)),
                                                  lambda: send_on(b, compute(i_act + 1, b, receive(b), settle)),
                                                  on_turn=lambda k, t, dt: turns[k].append((t, dt)))
                for release in settle:
                    release()
                count(a, sa, turns[0])
                count(b, sb, turns[1])
                n_pairs += 1
                i_act += 2
                continue
            inp = receive(a)
            tc = time.perf_counter()
            out = compute(i_act, a, inp)
            dt = time.perf_counter() - tc
            count(a, dt, [(tc, dt)])
            send_on(a, out)
            i_act += 1
        for r, _ in sends:
            r.wait()
        t_pipe = time.perf_counter() - t0
        self._final_backward(model.parameters())
        if self.partial_sync is not None:
            self.partial_sync.finish()
            model.notify_grad_ready(self.partial_sync.params, final=True)
        self._sum_tied_grad()
        losses = self.p2p.allreduce_sum(local_terms) if p > 1 else local_terms
        step = time.perf_counter() - t0
        f_s, b_s, w_s = by_stage.sum(axis=0)           # seconds per kind of action
        compute = float(f_s + b_s + w_s)
        self.stats = dict(loss=float(np.mean(losses)), losses=[float(x) for x in losses],  # host
                          bubble=1.0 - compute / step if step > 0 else 0.0,
                          recv_wait_s=recv_wait, compute_s=compute, pipeline_s=t_pipe, step_s=step,
                          f_s=float(f_s), b_s=float(b_s), w_s=float(w_s),
                          peak_in_flight=peak, activation_peak_bytes=int(peak_bytes), table_costs=used,
                          overlapped_pairs=n_pairs,
                          stage_times=by_stage / m,
                          recv_buffer_bytes=int(peak_posted * int(np.prod(shape)) * act_dtype.itemsize))
        return self.stats

    def _final_backward(self, params):
        for hook in self.final_backward_hooks:
            hook(params)

    def _sum_tied_grad(self):
        """wte.grad (first stage: embedding part; last: lm_head part) := their sum, on both."""
        model = self.model
        if model.tied_weight is None or "pp" not in param_placement(model.tied_weight).partial:
            return                     # no pipeline, or both ends on this rank (the V: one wte)
        other = model.part.rank_of(0 if model.is_last else model.part.n_stage - 1)[0]
        if self.exact_tied is not None:                # --deterministic: the two stages' exact sums merged
            acc = self.exact_tied(model.tied_weight)
            got = []
            for mine in (acc.top, acc.bins):
                peer = np.empty_like(mine)                  # host: the exact sum's integer bins
                rr = self.p2p.irecv(peer, other, TIED_TAG)
                sr = self.p2p.isend(np.ascontiguousarray(mine), other, TIED_TAG)   # host bins
                rr.wait()
                sr.wait()
                got.append(peer)
            acc.merge(type(acc).from_arrays(acc.dtype, acc.shape, *got))
            return
        g = model.tied_weight.grad
        xp = xp_of(g)
        peer = xp.empty_like(g)
        if self.p2p.channels is not None:
            self.p2p.channels.exchange_tied(xp.ascontiguousarray(g), peer)
        else:
            rr = self.p2p.irecv(peer, other, TIED_TAG)
            sr = self.p2p.isend(xp.ascontiguousarray(g), other, TIED_TAG)
            rr.wait()
            sr.wait()
        g += peer                      # g0 + g_last on both ranks: addition commutes, so bitwise equal
        model.notify_grad_ready([model.tied_weight], final=True)

    # --- evaluation ----------------------------------------------------------------------
    def forward_loss(self, micro_batches) -> float:
        """Mean loss over micro-batches without gradients (forwards only, GPipe order)."""
        model, p, v = self.model, self.model.pp, self.model.v
        xp = model.xp
        m = len(micro_batches)
        B, T = np.shape(micro_batches[0][0])
        shape, dt = model.activation_shape(B, T), model.act_dtype
        local = np.zeros(m, dtype=np.float64)  # host: per-micro-batch losses (floats)
        sends = []
        layers = [moe for _, moe in model.moe_layers()]
        for moe in layers:
            moe.recording = False        # an evaluation does not count expert loads
        # stage order within a micro-batch: chunk c of this rank after chunk c-1's round trip
        for c in range(v):
            chunk = model.chunks[c]
            for j, (idx, targets) in enumerate(micro_batches):
                s = chunk.stage
                if s == 0:
                    x = xp.asarray(idx)                                   # host tokens -> the device
                else:
                    x = xp.empty(shape, dtype=dt)
                    self.p2p.irecv(x, self._peer(s - 1), self._tag("F", j, c, m)).wait()
                y, _, terms = chunk.stage_forward(x, xp.asarray(targets) if chunk.head is not None else None)
                local[j] += terms
                if y is not None:
                    buf = xp.ascontiguousarray(y, dtype=dt)
                    sends.append((self.p2p.isend(buf, self._peer(s + 1), self._tag("F", j, self._chunk_of(s + 1), m)), buf))
        for r, _ in sends:
            r.wait()
        for moe in layers:
            moe.recording = True
        losses = self.p2p.allreduce_sum(local) if p > 1 else local
        return float(np.mean(losses))  # host


_KIND_LABEL = {"F": "fwd", "B": "bwd", "W": "wgrad"}



def build_pipeline(config, seed, pp_comm, *, schedule="1f1b", v=1, n_micro=None, dtype=np.float32,
                   compute_dtype=None, factory=None, channels=None):
    """Validate the layout (ValueError before any communication), build this rank's PipelineGPT
    and its PipelineExecutor over ``pp_comm`` (its rank is the stage; ``channels``: see
    PipelineExecutor). Returns (model, executor)."""
    p2p = _P2P(pp_comm)
    part = validate_pipeline(config, p2p.size, n_micro if n_micro is not None else p2p.size, schedule, v)
    model = PipelineGPT(config, seed, pp=p2p.size, rank=p2p.rank, v=v, dtype=dtype,
                        compute_dtype=compute_dtype, factory=factory, part=part)
    return model, PipelineExecutor(model, pp_comm, schedule, channels=channels)
