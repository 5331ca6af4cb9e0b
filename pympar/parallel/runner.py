"""The seam between the trainer and the parallel strategies.

``build_runner(model_cfg, layout, comm, opts, rec)`` returns a ``Runner``; the trainer only
ever calls

    runner.train_step(micro_batches, lr) -> dict(loss, grad_norm, loss_scale, skipped, moe, time_split)
    runner.eval_loss(batches)             -> float, the mean loss over the batches of all DP ranks
    runner.generate(prompt, n, top_k, rng) -> (1, T+n) tokens on world rank 0, None elsewhere
    runner.n_params, runner.model_cfg

``micro_batches`` is this rank's list of (idx (B,T), targets (B,T)) for the step, i.e. the
global micro-batches g = dp_rank*n_micro + j (see pympar.data). Every loss is the mean over
all micro-batches of the global batch, so every layout computes the same step.

Implemented here: ``DataParallelRunner`` -- one process (dp=1: gradient accumulation) or
plain data parallelism (all gradients in one flat buffer, one allreduce per step, averaged
over dp). Pipeline, tensor and expert parallelism, ZeRO, bucketed/overlapped or
compressed DP plug in as further Runner classes chosen in ``build_runner``; until they do,
``check_supported`` rejects such layouts at validation time (before any collective).
"""
from __future__ import annotations

import time

import numpy as np

from .. import profile as _profile
from ..nn import GPT
from ..optim import AdamW, DynamicLossScaler, clip_grad_norm
from .dp import DataParallel
from .ep import EPGradSync, ep_step_stats, install_expert_parallel, is_expert_param, lockstep_forward_losses
from .mesh import Mesh


class NotSupportedError(ValueError):
    """The configuration is valid but this build has no strategy for it yet."""


def check_supported(model_cfg, layout, opts) -> None:
    """Raise NotSupportedError for what no Runner implements yet (no communication)."""
    for k in ("pp", "tp"):
        if getattr(layout, k) > 1:
            raise NotSupportedError(f"{k}={getattr(layout, k)} is not yet supported by this build's trainer "
                                    f"(only data parallelism: launch with --{k} 1)")
    if layout.ep > 1 and opts.zero:
        raise NotSupportedError(f"--zero {opts.zero} with ep={layout.ep} is not yet supported by this build's "
                                f"trainer (use --zero 0 with expert parallelism)")
    if opts.zero not in (0, 1):
        raise NotSupportedError(f"zero={opts.zero} is not yet supported by this build's trainer (use --zero 0 or 1)")
    if opts.seq_parallel:
        raise NotSupportedError("--seq-parallel is not yet supported by this build's trainer (it needs tp > 1)")
    if opts.device != "cpu":
        raise NotSupportedError(f"--device {opts.device} is not yet supported by this build's trainer (use cpu)")


def build_runner(model_cfg, layout, comm, opts, rec=_profile.NULL):
    """The Runner for this layout (see the module docstring); comm is the world communicator."""
    check_supported(model_cfg, layout, opts)
    return DataParallelRunner(model_cfg, layout, comm, opts, rec)


class DataParallelRunner:
    """Full model replica per rank; gradients averaged over dp with one flat allreduce."""

    def __init__(self, model_cfg, layout, comm, opts, rec=_profile.NULL):
        self.model_cfg, self.layout, self.comm, self.rec = model_cfg, layout, comm, rec
        self.dp = layout.dp
        if comm.size != self.dp:
            raise ValueError(f"DataParallelRunner needs a communicator of size dp={self.dp}, got {comm.size}")
        compute = None if opts.dtype == "float32" else opts.dtype
        self.model = GPT(model_cfg, seed=opts.seed, dtype=np.float32, compute_dtype=compute)
        self.ep_comm = None
        if layout.ep > 1:     # expert parallelism (pympar.parallel.ep): keep n_expert/ep experts
            mesh = Mesh(comm, dp=self.dp, ep=layout.ep)
            self.ep_comm = install_expert_parallel(self.model, mesh.ep_comm).ep_comm
        named = list(self.model.named_parameters())
        self.params = [p for _, p in named]
        self.n_params = sum(p.data.size for p in self.params)
        if self.ep_comm is not None:   # the whole model's size: the other ep ranks' experts too
            self.n_params += (layout.ep - 1) * sum(p.data.size for n, p in named if is_expert_param(n))
        # dp > 1: DataParallel syncs the grads (buckets overlapped with backward, ZeRO-1,
        # compression); self.flat then carries only [loss_sum, moe stats...]
        self.sync = None
        if self.dp > 1:
            compress = f"topk:{opts.topk_ratio}" if opts.compress == "topk" else opts.compress
            kw = dict(bucket_mb=opts.bucket_mb, compress=compress, overlap=getattr(opts, "dp_overlap", True))
            if self.ep_comm is not None:   # dense grads over dp, expert grads over edp (sum / dp)
                self.sync = EPGradSync(named, mesh, **kw).attach(self.model)
            else:
                self.sync = DataParallel(named, comm, zero=opts.zero == 1, **kw).attach(self.model)
        # otherwise every .grad becomes a view of one flat buffer: [grads..., loss_sum, moe stats...]
        self.n_moe = len(self.model.moe_layers())
        n_extra = 1 + self.n_moe * (model_cfg.n_expert + 1)
        self._g0 = 0 if self.sync else self.n_params
        self.flat = np.zeros(self._g0 + n_extra, dtype=np.float32)
        off = 0
        for p in self.params if not self.sync else ():
            p.grad = self.flat[off:off + p.data.size].reshape(p.data.shape)
            off += p.data.size
        self._grads = [p.grad for p in self.params]
        self.opt = AdamW(named, lr=opts.lr, weight_decay=opts.weight_decay)
        self.grad_clip = opts.grad_clip
        self.scaler = DynamicLossScaler() if opts.dtype == "float16" else None
        self._mb = 0
        if rec.enabled:
            self._instrument_layers()

    # --- one optimizer step ------------------------------------------------------------------
    def train_step(self, micro_batches, lr) -> dict:
        if self.sync:
            self.model.zero_grad()
            self.sync.begin_step()
        elif any(p.grad is not g for p, g in zip(self.params, self._grads)):
            raise RuntimeError("a parameter's .grad was replaced; DataParallelRunner keeps them as views of its flat buffer")
        self.flat[:] = 0
        n = len(micro_batches)
        scale = self.scaler.scale if self.scaler else 1.0
        loss_sum = 0.0
        for j, (idx, targets) in enumerate(micro_batches):
            self._mb = j
            if self.sync:
                self.sync.begin_micro(last=(j == n - 1))
            with self.rec.span(f"micro-batch {j}", "compute", mb=j):
                loss_sum += self.model.loss_and_grad(idx, targets, grad_scale=scale / n)
        extra = self.flat[self._g0:]
        extra[0] = loss_sum / n
        moe = self.model.moe_stats()
        for i, st in enumerate(moe):
            k = 1 + i * (self.model_cfg.n_expert + 1)
            extra[k:k + self.model_cfg.n_expert] = st["tokens_per_expert"]
            extra[k + self.model_cfg.n_expert] = st["dropped_fraction"]
        if self.dp > 1:
            with self.rec.span("dp grad sync", "dp_comm", bytes=self.sync.grad_bytes):
                self.sync.finish()
            with self.rec.span("allreduce loss", "dp_comm", bytes=int(self.flat.nbytes)):
                reduced = self.comm.allreduce(self.flat)
                if reduced is not None and reduced is not self.flat:
                    self.flat[:] = reduced
            self.flat *= np.float32(1.0 / self.dp)
        loss = float(extra[0])
        for i, st in enumerate(moe):
            k = 1 + i * (self.model_cfg.n_expert + 1)
            st["tokens_per_expert"] = [int(round(v * self.dp)) for v in extra[k:k + self.model_cfg.n_expert]]
            st["dropped_fraction"] = float(extra[k + self.model_cfg.n_expert])
        if self.ep_comm is not None:
            for st, es in zip(moe, ep_step_stats(self.model, self.comm)):
                st.update(a2a_seconds=es["a2a_seconds"], a2a_bytes=es["a2a_bytes"])
        with self.rec.span("optimizer", "optimizer"):
            skipped = False
            if self.scaler:
                grads = self.flat[:self.n_params]
                finite = self.sync.grads_finite() if self.sync else np.isfinite(grads).all()
                skipped = self.scaler.update(not finite)
                if self.sync:
                    self.sync.scale_grads(1.0 / scale)
                else:
                    grads *= np.float32(1.0 / scale)
            if skipped:
                norm = float("nan")
            elif self.sync:
                norm = self.sync.step(self.opt, lr=lr, clip=self.grad_clip)
            else:
                norm = clip_grad_norm(self.params, self.grad_clip)
                self.opt.step(lr=lr)
            if not skipped:
                # aux-loss-free balancing must see the global loads, or replicas drift apart
                for (_, layer), st in zip(self.model.moe_layers(), moe):
                    layer._load_since_update = np.asarray(st["tokens_per_expert"], np.int64)
                self.model.update_expert_bias()
        return dict(loss=loss, grad_norm=norm, loss_scale=scale, skipped=skipped, moe=moe,
                    time_split=self.rec.take_totals() if hasattr(self.rec, "take_totals") else {})

    # --- evaluation and sampling ---------------------------------------------------------------
    def eval_loss(self, batches) -> float:
        """Mean forward loss over this rank's batches and those of the other DP ranks."""
        with self.rec.span("eval", "eval", n=len(batches)):
            losses = lockstep_forward_losses(self.model, batches, self.ep_comm)
            local = np.array([sum(losses), len(batches)], np.float64)
            tot = self.comm.allreduce(local) if self.dp > 1 else local
            tot = local if tot is None else tot
        return float(tot[0] / max(tot[1], 1))

    def generate(self, prompt, n, top_k, rng):
        if self.comm.rank != 0 and self.ep_comm is None:
            return None
        # with expert parallelism every rank runs it (same prompt and rng): MoE layers exchange tokens
        toks = self.model.generate(prompt, n, top_k=top_k, rng=rng)
        return toks if self.comm.rank == 0 else None

    # --- profiling ------------------------------------------------------------------------------
    def _instrument_layers(self):
        """Wrap each layer's forward/backward so the trace shows them per micro-batch."""
        m = self.model
        layers = [("embedding", m.embedding)] + [(f"h.{i}", b) for i, b in enumerate(m.h)] + [("head", m.head)]
        for name, mod in layers:
            for kind in ("forward", "backward"):
                fn = getattr(mod, kind)
                setattr(mod, kind, self._timed(fn, f"{'fwd' if kind == 'forward' else 'bwd'} {name}"))

    def _timed(self, fn, label):
        rec = self.rec

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                rec.add(label, "layer", t0, time.perf_counter() - t0, mb=self._mb)
        return wrapped
