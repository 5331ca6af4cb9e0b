"""TPGPT: the GPT of pympar.nn, tensor-parallel over a tp communicator (Megatron layout).

Same public face as nn.GPT (loss_and_grad, forward_loss, logits, generate, zero_grad,
named_parameters with GLOBAL names and ``.shard`` on the split ones, embedding/h/head for
pipeline slicing, moe_stats, update_expert_bias, grad_ready_hooks). Every tp rank gets the same
micro-batch; the loss it returns is identical on all of them.

Sequence parallelism (``sequence_parallel=True``): activations between the tensor-parallel
regions are (B, T/tp, C). Replicated parameters that only see this rank's rows (LayerNorms,
wpe, row-parallel biases: ``sp_partial_params()``) have partial gradients; loss_and_grad sums
THIS micro-batch's contribution over tp (one allreduce of their concatenation) before returning,
so .grad is always complete. A pipeline executor that drives embedding/h/head itself does the
same with ``SPGradSync`` around its backward passes.
"""
from __future__ import annotations

import numpy as np

from ...backend import held_bytes, to_numpy, xp_of
from ...nn.config import GPTConfig
from ...nn.gpt import GPT, GPTParts
from ..placement import partial_over, place
from ..shard import shard_of
from .block import TPBlock
from .collectives import as_collectives
from .cross_entropy import VocabParallelHead
from .embedding import VocabParallelEmbedding
from .validate import validate_tp


class SPGradSync:
    """Sum over tp the gradient added to ``params`` since ``begin()`` (one allreduce)."""

    def __init__(self, params, tp):
        self.params, self._tp = list(params), as_collectives(tp)
        self._snap = None

    def begin(self):
        # a released gradient (ZeRO-2/3) is zero: nothing to keep
        self._snap = [p.grad.copy() if p.has_grad else None for p in self.params]

    def finish(self):
        if not self.params:
            return
        xp = xp_of(self.params[0].grad)
        delta = xp.concatenate([(p.grad - s if s is not None else p.grad).ravel()
                                for p, s in zip(self.params, self._snap)])
        delta = self._tp.allreduce(delta)
        lo = 0
        for p, s in zip(self.params, self._snap):
            n = p.grad.size
            d = delta[lo:lo + n].reshape(p.grad.shape)
            p.grad[...] = d if s is None else s + d
            lo += n
        self._snap = None


class TPParts(GPTParts):
    """nn.GPTParts' contract with the pieces split over the tp group (Megatron layout): the
    vocab-parallel embedding and head, TPBlock (attention by heads, MLP by its width, experts
    split over tp or folded apart from it: etp / fold); with sequence parallelism the
    activations between blocks are (B, T/tp, C). TPGPT is a GPT made of these parts, and a
    tensor-parallel pipeline stage is made of the same."""

    def __init__(self, tp_comm, *, dtype=np.float32, compute_dtype=None, sequence_parallel=False,
                 etp_comm=None, fold_comm=None):
        super().__init__(dtype, compute_dtype, "TPGPT")
        self.tp = as_collectives(tp_comm)
        self.sequence_parallel, self.etp, self.fold = sequence_parallel, etp_comm, fold_comm

    @staticmethod
    def _placed(piece):
        """piece, its sequence-parallel partial parameters placed partial over tp."""
        place(piece.sp_partial_params(), partial=("tp",))
        return piece

    def embedding(self, config, seed):
        return self._placed(VocabParallelEmbedding(config.vocab_size, config.block_size, config.n_embd, self.tp,
                                                   seed=seed, dtype=self.dtype, sequence_parallel=self.sequence_parallel,
                                                   compute_dtype=self.compute_dtype))

    def block(self, config, i, seed):
        return self._placed(TPBlock(config, i, self.tp, seed=seed, dtype=self.dtype,
                                    sequence_parallel=self.sequence_parallel, compute_dtype=self.compute_dtype,
                                    etp=self.etp, fold=self.fold))

    def head(self, config, embedding, seed):
        return self._placed(VocabParallelHead(config, embedding, self.tp, dtype=self.dtype,
                                              sequence_parallel=self.sequence_parallel,
                                              compute_dtype=self.compute_dtype))

    def activation_shape(self, config, B, T):
        """(B, T, C); (B, T/tp, C) with sequence parallelism."""
        return (B, T // self.tp.size if self.sequence_parallel else T, config.n_embd)

    def partial_grad_sync(self, params):
        """Sums over tp the sequence-parallel partial gradients of ``params``."""
        return SPGradSync(params, self.tp)


def apply_tp(mesh, *, dtype=np.float32, compute_dtype=None, sequence_parallel=False, meter=None):
    """Tensor parallelism's step of ``parallelize`` (tp > 1): the parts of this rank of ``mesh``,
    TPParts over the tp group (one TPCollectives, so one meter, for every piece and every pipeline
    chunk), with the experts over their own groups when folded apart from tp (mesh.fold > 1)."""
    from .collectives import TPCollectives

    tpc = TPCollectives(mesh.tp_comm, meter=meter)
    etpc = foldc = None
    if mesh.fold > 1:
        etpc, foldc = TPCollectives(mesh.etp_comm, meter=meter), TPCollectives(mesh.fold_comm, meter=meter)
    return TPParts(tpc, dtype=dtype, compute_dtype=compute_dtype, sequence_parallel=sequence_parallel,
                   etp_comm=etpc, fold_comm=foldc)


class TPGPT(GPT):
    def __init__(self, config: GPTConfig, tp_comm=None, seed: int = 0, dtype=np.float32,
                 sequence_parallel: bool = False, compute_dtype=None, etp_comm=None, fold_comm=None, *,
                 parts: TPParts | None = None):
        """nn.GPT made of TPParts: ``parts`` (apply_tp's; the other arguments but seed are then
        its), or new ones from these arguments. tp_comm: the tp group's Communicator, or a
        TPCollectives over it (its meter then gets the TP collectives' seconds: see pympar.parallel.meter).
        etp_comm, fold_comm: the experts folded apart from the tp group (parallel.mesh: etp < tp):
        each expert split over etp_comm (its ranks' experts whole when it has one rank), and the
        tp group's expert rows shared out over fold_comm; None: the experts split over tp.
        compute_dtype: None, 'float16' or 'bfloat16': mixed precision exactly as nn.GPT (float32
        master weights and grads, low-precision GEMMs accumulating in float32, softmax and
        LayerNorm statistics in float32); partial sums over tp are reduced in float32."""
        if parts is None:
            parts = TPParts(tp_comm, dtype=dtype, compute_dtype=compute_dtype, sequence_parallel=sequence_parallel,
                            etp_comm=etp_comm, fold_comm=fold_comm)
        tpc = parts.tp
        validate_tp(config, tpc.size, parts.sequence_parallel)     # no communication: all ranks agree
        super().__init__(config, seed, parts=parts)
        self.tp, self.sequence_parallel = tpc, parts.sequence_parallel
        self._sp_sync = SPGradSync(self.sp_partial_params(), tpc)
        self._sp_ids = {id(p) for p in self._sp_sync.params}

    # --- tensor-parallel bookkeeping -----------------------------------------------------------
    def sp_partial_params(self):
        """Replicated parameters whose per-rank gradient is partial under sequence parallelism
        (placed partial over tp by TPParts)."""
        return partial_over(self.parameters(), "tp")

    def sharded_state(self):
        """{global name: (local array, Shard or None)}: what pympar.checkpoint stores."""
        return {n: (p.data, shard_of(p)) for n, p in self.named_parameters()}

    def state_dict(self):
        raise NotImplementedError("TPGPT holds shards: use sharded_state() (or load_full_state_dict "
                                  "to load a full nn.GPT state dict)")

    def load_full_state_dict(self, d):
        """Load a FULL state dict (nn.GPT.state_dict()): each rank keeps its slices. The state
        dict is host arrays; the slices are taken on the host and copied to the parameters' device."""
        for n, p in self.named_parameters():
            a = to_numpy(d[n])
            sh = shard_of(p)
            p.data[...] = xp_of(p.data).asarray(sh.take(a) if sh is not None else a)
        for i, m in self.moe_layers():
            key = f"transformer.h.{i}.moe.expert_bias"
            if key in d:
                m.expert_bias[...] = xp_of(m.expert_bias).asarray(to_numpy(d[key]))

    load_state_dict = load_full_state_dict

    # --- forward / backward ----------------------------------------------------------------------
    def _check_batch(self, idx):
        T = idx.shape[1]                         # idx: an array already on the model's device
        if self.sequence_parallel and T % self.tp.size:
            raise ValueError(f"sequence length T={T} is not divisible by tp={self.tp.size}: sequence "
                             f"parallelism splits every sequence into tp equal parts")

    def _forward(self, idx, targets):
        self._check_batch(idx)
        return super()._forward(idx, targets)

    def loss_and_grad(self, idx, targets, grad_scale=1.0, stats=None, trace=None) -> float:
        """One micro-batch: loss = mean CE + MoE aux + z (identical on every tp rank); grads of
        grad_scale * loss accumulate, complete (sequence-parallel partials summed over tp)."""
        if self._sp_sync.params:
            self._sp_sync.begin()
        loss = super().loss_and_grad(idx, targets, grad_scale, stats, trace)
        if self._sp_sync.params:
            self._sp_sync.finish()
            self.notify_grad_ready(self._sp_sync.params, final=True)
        return loss

    def later_grad_ids(self):
        return self._sp_ids                      # sequence-parallel partials: final after SPGradSync.finish()

    def logits(self, idx):                       # idx (B, T) -> (B, T, V), gathered on every rank
        idx, = self._inputs(idx)                 # on the parameters' device
        T, tp = idx.shape[1], self.tp.size
        if not self.sequence_parallel or T % tp == 0:
            return super().logits(idx)
        # sequence parallelism needs T % tp == 0: pad on the right (causal attention: the
        # padding cannot change the logits of the real positions) and crop
        xp = xp_of(idx)
        pad = xp.zeros((idx.shape[0], -(-T // tp) * tp - T), dtype=idx.dtype)
        return super().logits(xp.concatenate([idx, pad], axis=1))[:, :T]


def activation_bytes(model, idx, targets) -> int:
    """Activation memory of one micro-batch on this rank: the bytes its forward keeps for backward
    (each buffer once, views included in their base)."""
    _, _, ctxs = model._forward(*model._inputs(idx, targets))     # the batch on the model's device
    return held_bytes(ctxs)
