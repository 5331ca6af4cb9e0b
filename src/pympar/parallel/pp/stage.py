"""Build only this pipeline rank's chunks of a GPT, with global parameter names.

Each chunk IS an ``nn.GPT``, holding the pieces of one global stage (``GPT(..., blocks=,
embedding=, head=, stage=)``) made of the same parts as a whole model (nn.gpt.GPTParts'
contract: embedding, block, head and the activation shape between blocks): pympar.nn's by
default, a tensor-parallel stage's from parallel.tp.TPParts. ``PipelineGPT`` is this rank's
chunks together: the tied embedding/lm_head weight lives on the first stage (in the embedding)
and on the last (a fresh copy from the same (seed, name)), and the executor sums its gradient.
"""
from __future__ import annotations

import numpy as np

from ...backend import to_device, to_numpy, xp_of
from ...nn.gpt import GPT, GPTParts, GradReadyHooks
from ...nn.moe import MoEBookkeeping
from ..placement import param_placement, partial_over, place
from .partition import Partition, partition as make_partition

TIED_NAME = "transformer.wte.weight"


def as_parts(factory, dtype=np.float32, compute_dtype=None):
    if factory is None:
        return GPTParts(dtype, compute_dtype, "PipelineGPT")
    if all(hasattr(factory, k) for k in ("embedding", "block", "head")):
        return factory
    raise TypeError(f"model parts {factory!r} lack the embedding/block/head methods of nn.gpt.GPTParts")


def apply_pp(config, parts, mesh, layout, *, seed: int = 0, dtype=np.float32, compute_dtype=None):
    """Pipeline parallelism's step of ``parallelize`` (pp > 1): this pipeline rank's stages, made of
    ``parts`` (None: pympar.nn's), placed as the layout's schedule places them (the V of zb-v and
    dualpipev, else interleaved)."""
    from .schedules import placement_of

    return PipelineGPT(config, seed, pp=layout.pp, rank=mesh.pp_rank, v=layout.virtual_stages, dtype=dtype,
                       compute_dtype=compute_dtype, factory=parts, placement=placement_of(layout.schedule))


class PipelineGPT(MoEBookkeeping, GradReadyHooks):
    """The chunks of a GPT that pipeline rank ``rank`` of ``pp`` holds (v chunks: interleaved).

    Construction is pure (no communication). ``chunks[c]`` is global stage ``c*pp + rank``.
    Parameters keep their global names, so checkpoints and comparisons work by name.
    """

    def __init__(self, config, seed=0, *, pp=1, rank=0, v=1, dtype=np.float32, compute_dtype=None,
                 factory=None, part: Partition | None = None, placement: str = "interleaved"):
        self.config = config.validate()
        if not 0 <= rank < pp:
            raise ValueError(f"pipeline rank={rank} must be in 0..pp-1={pp - 1}")
        self.part = part or make_partition(config, pp, v, placement=placement)
        if (self.part.pp, self.part.v) != (pp, v):
            raise ValueError(f"partition is for pp={self.part.pp}, v={self.part.v}, not pp={pp}, v={v}")
        self.pp, self.rank, self.v, self.seed = pp, rank, v, seed
        fac = self._factory = as_parts(factory, dtype, compute_dtype)
        # callbacks h(params) told which parameters' grads are final for a micro-batch (as nn.GPT)
        self.grad_ready_hooks = []
        S = self.part.n_stage
        tied = None                              # the embedding the last stage's lm_head ties to
        self.chunks = []
        for s in self.part.stages_of(rank):
            if s == S - 1 and tied is None:      # the last stage's copy of wte: same (seed, name), same numbers
                tied = fac.embedding(config, seed)
            chunk = GPT(config, seed, parts=fac, blocks=self.part.blocks(s), embedding=s == 0, head=s == S - 1,
                        tied=tied, stage=s)
            if s == 0:
                tied = chunk.embedding
            self.chunks.append(chunk)
        self.tied_weight = tied.wte if tied is not None else None
        if pp > 1 and self.is_first != self.is_last and self.tied_weight is not None:
            # the tied wte on two ranks: each holds a part of its gradient (the executor sums them),
            # and the last stage's copy is not counted again in the norm or checkpoints
            place([self.tied_weight], partial=("pp",), tied_copy=self.is_last)
        # master dtype: the factory's, else the parameters' (a factory may ignore our dtype)
        own = [p.data.dtype for _, p in self.named_parameters()]
        self.dtype = np.dtype(getattr(fac, "dtype", None) or (own[0] if own else dtype))
        cdt = getattr(fac, "compute_dtype", None)
        # activations (and their gradients) travel between stages in this dtype
        self.act_dtype = np.dtype(cdt) if cdt is not None else self.dtype

    @property
    def is_first(self) -> bool:
        """This rank holds stage 0 (the embedding)."""
        return any(ch.embedding is not None for ch in self.chunks)

    @property
    def is_last(self) -> bool:
        """This rank holds the last stage (the head and the loss)."""
        return any(ch.head is not None for ch in self.chunks)

    @property
    def holds_tied_copy(self) -> bool:
        """True on the rank of the last stage when it does not hold stage 0 too: its wte duplicates
        stage 0's (in the V placement both are on rank 0: one wte, no copy)."""
        return self.pp > 1 and self.is_last and not self.is_first

    def named_parameters(self, include_tied_copy=True):
        """(global name, Parameter) of this rank; include_tied_copy=False drops the last rank's wte
        copy, so that a sum over pipeline ranks (gradient norm, checkpoint) counts it once."""
        seen = set()
        for ch in self.chunks:
            for n, p in ch.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield n, p
        if self.tied_weight is not None and id(self.tied_weight) not in seen:
            if include_tied_copy or not self.holds_tied_copy:
                yield TIED_NAME, self.tied_weight

    def parameters(self, include_tied_copy=True):
        return [p for _, p in self.named_parameters(include_tied_copy)]

    @property
    def xp(self):
        """The array module of this rank's parameters (numpy, or cupy after ``to("cuda")``)."""
        for p in self.parameters():
            return xp_of(p.data)
        return np

    def modules(self):
        """The pieces this rank holds (embedding, blocks, head of each chunk), each once."""
        seen = set()
        for ch in self.chunks:
            for mod in ch.pieces():
                if id(mod) not in seen:
                    seen.add(id(mod))
                    yield mod

    def to(self, device: str):
        """Move every parameter (data and grad) and module buffer (MoE selection bias) to 'cpu'
        or 'cuda' in place; returns self. Each piece moves itself (nn.Module.to); the last
        stage's tied wte copy belongs to no piece (the head only refers to it), so it moves here."""
        for mod in self.modules():
            mod.to(device)
        w = self.tied_weight
        if w is not None:             # a no-op where the embedding already moved it
            w.data = to_device(w.data, device)
            if w.has_grad:
                w.grad = to_device(w.grad, device)
        return self

    def activation_shape(self, B, T):
        """Shape of the activations (and gradients) that travel between stages."""
        if hasattr(self._factory, "activation_shape"):
            return tuple(self._factory.activation_shape(self.config, B, T))
        return (B, T, self.config.n_embd)

    def sp_partial_params(self):
        """This rank's parameters whose gradient is partial per tp rank (sequence parallelism: placed
        partial over tp by the parts that made them, tp.TPParts)."""
        return partial_over(self.parameters(), "tp")

    def make_partial_grad_sync(self):
        """An object with begin()/finish() summing the partial grads over tp, or None."""
        params = self.sp_partial_params()
        if not params:
            return None
        if not hasattr(self._factory, "partial_grad_sync"):
            raise ValueError("the model has sequence-parallel partial gradients but its factory has no "
                             "partial_grad_sync(params) to sum them over tp")
        return self._factory.partial_grad_sync(params)

    def notify_chunk_ready(self, chunk):
        """After a chunk's backward: its parameters' grads are final for this micro-batch, except
        the tied wte when pp > 1 (final only after the first/last-stage sum) and sequence-parallel
        partial grads (final after the tp sum at the end of the step): ``later_grad_ids``."""
        if self.grad_ready_hooks:
            self.notify_grad_ready([p for _, p in chunk.named_parameters()])

    def later_grad_ids(self):
        """ids of the parameters whose grads are completed after the actions: those placed partial
        (the sequence-parallel partials over tp, the tied wte over the pipeline's ends)."""
        if getattr(self, "_later_ids", None) is None:      # the Parameter objects never change
            self._later_ids = {id(p) for p in self.parameters() if param_placement(p).partial}
        return self._later_ids

    def zero_grad(self):
        for p in self.parameters():
            p.zero_grad()

    def state_dict(self):
        """This rank's parameters (global names, host numpy copies; wte once, on the first rank)."""
        d = {n: np.array(to_numpy(p.data)) for n, p in self.named_parameters(include_tied_copy=False)}  # host
        for i, m in self.moe_layers():
            d[f"transformer.h.{i}.moe.expert_bias"] = np.array(to_numpy(m.expert_bias))  # host
        return d

    def sharded_state(self):
        """{global name: (local array, Shard or None)} of this rank for pympar.checkpoint; the tied
        wte once over the pipeline (on stage 0)."""
        return {n: (p.data, getattr(p, "shard", None)) for n, p in self.named_parameters(include_tied_copy=False)}

    def moe_layers(self):
        """(global block index, MoE) for the MoE blocks on this rank."""
        return [layer for ch in self.chunks for layer in ch.moe_layers()]

