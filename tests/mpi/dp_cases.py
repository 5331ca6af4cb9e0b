"""Shared pieces of the data-parallel MPI tests: tiny models, the global batch, the
single-process reference and the same steps under DataParallel."""

import numpy as np

from pympar.nn import GPT
from pympar.nn.config import GPTConfig
from pympar.optim import AdamW, clip_grad_norm
from pympar.parallel.dp import DataParallel

TINY = dict(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
MOE = dict(TINY, n_expert=4, top_k=2)
B, T, LR, CLIP = 2, 8, 1e-2, 0.5


def dp_communicator(mpi_world):
    from pympar.comm import MPIComm

    return MPIComm(mpi_world)


def global_batch(step, n_global, vocab=64):
    """Micro-batches g = 0 .. n_global-1 of a step: [(idx (B,T), targets (B,T))]."""
    rng = np.random.default_rng([11, step])
    toks = rng.integers(0, vocab, size=(n_global, B, T + 1))
    return [(t[:, :-1], t[:, 1:]) for t in toks]


def _model(cfg, dtype):
    model = GPT(GPTConfig(**cfg), seed=3, dtype=dtype)
    return model, AdamW(model.named_parameters(), lr=LR)


def run_single(cfg, dtype, n_global, steps):
    """One process, gradient accumulation over the whole global batch."""
    model, opt = _model(cfg, dtype)
    losses, norms = [], []
    for s in range(steps):
        model.zero_grad()
        mbs = global_batch(s, n_global, cfg["vocab_size"])
        loss = sum(model.loss_and_grad(x, y, grad_scale=1.0 / n_global) for x, y in mbs) / n_global
        norms.append(clip_grad_norm(model.parameters(), CLIP))
        opt.step()
        losses.append(loss)
    return dict(losses=losses, norms=norms, params={n: p.data.copy() for n, p in model.named_parameters()})


class Counting:
    """A communicator proxy recording (collective, phase) for every collective call."""

    COLLECTIVES = {"allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "allgather",
                   "iallgather", "alltoall", "ialltoall", "broadcast", "barrier"}

    def __init__(self, comm):
        self._comm = comm
        self.calls = []
        self.phase = "setup"

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in self.COLLECTIVES:
            return attr

        def call(*a, **k):
            self.calls.append((name, self.phase))
            return attr(*a, **k)
        return call


def run_dp(comm, cfg, dtype, n_micro, steps, **dp_kw):
    """The same steps with this rank's micro-batches g = rank*n_micro + j and DataParallel."""
    model, opt = _model(cfg, dtype)
    dp = DataParallel(model.named_parameters(), comm, **dp_kw).attach(model)
    n_global = n_micro * comm.size
    losses, norms = [], []
    tag = comm if isinstance(comm, Counting) else None
    for s in range(steps):
        model.zero_grad()
        mine = global_batch(s, n_global, cfg["vocab_size"])[comm.rank * n_micro:(comm.rank + 1) * n_micro]
        dp.begin_step()
        local = 0.0
        for j, (x, y) in enumerate(mine):
            if tag:
                tag.phase = f"micro {j}"
            dp.begin_micro(last=(j == n_micro - 1))
            local += model.loss_and_grad(x, y, grad_scale=1.0 / n_micro)
        if tag:
            tag.phase = "finish"
        dp.finish()
        if tag:
            tag.phase = "step"
        norms.append(dp.step(opt, clip=CLIP))
        tot = comm.allreduce(np.array([local / n_micro]))
        losses.append(float(np.asarray(tot).reshape(-1)[0]) / comm.size)
    return dict(losses=losses, norms=norms, dp=dp,
                params={n: p.data.copy() for n, p in model.named_parameters()},
                shards={n: p.shard for n, p in model.named_parameters()})   # ZeRO-3: rows of the full tensors


def synced_grads(comm, cfg, dtype, n_micro, **dp_kw):
    """The gradients after DataParallel.finish() of step 0, and the DataParallel."""
    model, _ = _model(cfg, dtype)
    dp = DataParallel(model.named_parameters(), comm, **dp_kw).attach(model)
    mine = global_batch(0, n_micro * comm.size, cfg["vocab_size"])[comm.rank * n_micro:(comm.rank + 1) * n_micro]
    dp.begin_step()
    for j, (x, y) in enumerate(mine):
        dp.begin_micro(last=(j == n_micro - 1))
        model.loss_and_grad(x, y, grad_scale=1.0 / n_micro)
    dp.finish()
    return {n: p.grad.copy() for n, p in model.named_parameters()}, dp
