"""GPT: Embedding -> Blocks (pre-LN, attention + MLP or MoE) -> Head (ln_f, tied lm_head, CE).

The three pieces are separate modules so a pipeline stage can hold any slice of them.
Gradient convention: see pympar/nn/parameter.py (param grads +=, activation grads =).
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import kernels
from ..backend import held_bytes, to_numpy, xp_of
from ..comm.progress import poke
from .attention import CausalSelfAttention
from .config import GPTConfig
from .layers import MLP, MLP_ROWS, Embedding, LayerNorm
from .moe import MoE, MoEBookkeeping
from .module import Module, NoGather
from .products import compute_cast, compute_copies, compute_weight, matmul, resolve_precision
from .wgrad import WeightGrads, product_grad


class Block(Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)) (or + moe(ln_2(x)))."""

    def __init__(self, config: GPTConfig, i: int, *, seed=0, dtype=np.float32, compute_dtype=None):
        c = config
        name = f"transformer.h.{i}"
        mk = dict(seed=seed, dtype=dtype, bias=c.bias, n_layer=c.n_layer, compute_dtype=compute_dtype)
        self.ln_1 = LayerNorm(c.n_embd, name=f"{name}.ln_1", dtype=dtype, bias=c.bias, eps=c.ln_eps)
        self.attn = CausalSelfAttention(c.n_embd, c.n_head, name=f"{name}.attn", **mk)
        self.ln_2 = LayerNorm(c.n_embd, name=f"{name}.ln_2", dtype=dtype, bias=c.bias, eps=c.ln_eps)
        if c.is_moe_block(i):
            self.moe = MoE(c.n_embd, c.n_expert, name=f"{name}.moe", top_k=c.top_k,
                           capacity_factor=c.capacity_factor, aux_coef=c.aux_coef, z_coef=c.z_coef,
                           shared_expert=c.shared_expert, bias_update_rate=c.bias_update_rate, **mk)
        else:
            self.mlp = MLP(c.n_embd, name=f"{name}.mlp", **mk)

    @property
    def ffn(self):
        return self.moe if hasattr(self, "moe") else self.mlp

    # activation recomputation: "none" keeps every activation backward needs; "full" keeps only
    # the block's input and runs the forward again in backward (all of it but a dense MLP, whose
    # backward computes its hidden layer block by block); "selective" drops the attention
    # probabilities (B, nh, T, T; the tiled attention kernel keeps none in any mode) and a dense
    # MLP's hidden layer (set_recompute sets them on the attention core and the MLP)
    recompute = "none"

    def forward(self, x):                        # x (B, T, C) -> y (B, T, C)
        y, ctx = self._forward(x)
        if self.recompute == "full":             # keep x only: backward runs the forward again
            return y, dict(recompute=x, aux_loss=ctx["aux_loss"])
        return y, ctx

    # The LayerNorms' outputs are not kept: the attention's and the MLP's ctx (tuples whose first
    # item is the module's input) drop it, and backward computes it again from the LayerNorm's
    # ctx (its input, kept anyway for its own backward) -- one elementwise pass each, bitwise the
    # same numbers, 2C per position and layer less to hold. A MoE's ctx (a dict) keeps its input.
    def _forward(self, x, again=False):
        """again: the forward of a "full" backward, for its ctx only: a dense MLP that does not keep
        its hidden layer (the MLP's backward computes it block by block) is not run at all."""
        h1, c_ln1 = self.ln_1.forward(x)
        a, c_attn = self.attn.forward(h1)
        del h1
        poke()                                   # exchanges in flight behind this compute (comm.progress)
        h2, c_ln2 = self.ln_2.forward_add(a, x)  # x1 = a + x in place (a is fresh, kept by no
        x1 = a                                   # ctx) and ln_2 of it, in one pass
        if again and not hasattr(self, "moe") and not self.mlp.keep_hidden:
            return None, dict(ln1=c_ln1, attn=_without_input(c_attn), ln2=c_ln2, ffn=(h2, None), aux_loss=0.0)
        if hasattr(self, "moe"):
            f, c_ffn = self.moe.forward(h2)
        else:                                    # f written over h2, which backward computes again
            f, c_ffn = self.mlp.forward(h2, consume=True)
        del h2
        f += x1                                  # y = x1 + f: f is fresh too
        y = f
        aux = c_ffn["aux_loss"] if isinstance(c_ffn, dict) else 0.0
        return y, dict(ln1=c_ln1, attn=_without_input(c_attn), ln2=c_ln2, ffn=_without_input(c_ffn),
                       aux_loss=aux)

    def _recomputed(self, ctx):
        """The full ctx of a "full"-recomputation ctx: the same forward again (MoE loads are not
        counted twice), so backward sees bitwise the numbers the first forward made."""
        moe = getattr(self, "moe", None)
        rec = moe.recording if moe is not None else None
        if moe is not None:
            moe.recording = False
        try:
            return self._forward(ctx["recompute"], again=True)[1]
        finally:
            if moe is not None:
                moe.recording = rec

    def backward(self, dy, ctx, daux=1.0):      # dy (B, T, C) -> dx (B, T, C)
        if "recompute" in ctx:
            ctx = self._recomputed(ctx)
        if hasattr(self, "moe"):
            dh2 = self.moe.backward(dy, _with_input(ctx.pop("ffn"), self.ln_2, ctx["ln2"]), daux)
        else:
            dh2 = self.mlp.backward(dy, _with_input(ctx.pop("ffn"), self.ln_2, ctx["ln2"]), consume=True)
        dx1 = self.ln_2.backward(dh2, ctx.pop("ln2"), residual=dy)   # + the residual's dy, one pass
        del dh2                                  # (x1, in ln2's ctx, is let go here too)
        poke()
        dh1 = self.attn.backward(dx1, _with_input(ctx.pop("attn"), self.ln_1, ctx["ln1"]))
        poke()
        return self.ln_1.backward(dh1, ctx.pop("ln1"), residual=dx1)


def _span(trace, label):
    """trace(label) (a context manager around one piece's work), or nothing when not tracing."""
    return contextlib.nullcontext() if trace is None else trace(label)


def _without_input(ctx):
    """A module's ctx without its input (the first item of a tuple ctx; a dict ctx as it is)."""
    return (None,) + tuple(ctx[1:]) if isinstance(ctx, tuple) else ctx


def _with_input(ctx, ln, ln_ctx):
    """The ctx ``_without_input`` made, with the input ``ln`` produced computed again."""
    if isinstance(ctx, tuple) and ctx[0] is None:
        return (ln.output(ln_ctx),) + ctx[1:]
    return ctx


RECOMPUTE = ("none", "selective", "full")


def count_params(config: GPTConfig) -> int:
    """Parameters of the whole model (the tied wte once), from the shapes alone (nothing is made)."""
    return int(sum(int(np.prod(p.shape)) for _, p in GPT(config).named_parameters()))


def set_recompute(model, mode: str):
    """Activation recomputation of every block of ``model`` (any model whose modules() reach its
    blocks: GPT, TPGPT, PipelineGPT): none | selective (attention probabilities, a dense MLP's
    hidden layer) | full (blocks)."""
    from .attention_core import CausalAttentionCore

    if mode not in RECOMPUTE:
        raise ValueError(f"recompute={mode!r}: expected one of {RECOMPUTE}")
    for m in model.modules():
        if isinstance(m, Block):
            m.recompute = "full" if mode == "full" else "none"
            if hasattr(m, "mlp") and m.mlp.rowwise:          # (a tensor-parallel MLP keeps it)
                m.mlp.keep_hidden = mode == "none"
        if isinstance(m, CausalAttentionCore):
            m.keep_probs = mode != "selective"
    return model


class Head(Module):
    """ln_f, lm_head tied to the token embedding, mean cross-entropy over targets >= 0."""

    def __init__(self, config: GPTConfig, wte, *, dtype=np.float32, compute_dtype=None):
        self.ln_f = LayerNorm(config.n_embd, name="transformer.ln_f", dtype=dtype,
                              bias=config.bias, eps=config.ln_eps)
        self._wte = wte                          # the SAME Parameter as Embedding.wte
        self._cdt = compute_dtype

    @property
    def wte(self):
        return self._wte

    def logits(self, x):                         # x (B, T, C) -> logits (B, T, V)
        h, _ = self.ln_f.forward(x)
        return self._logits(h.reshape(-1, h.shape[-1]), self._w()).reshape(*h.shape[:-1], -1)

    def _w(self):
        return compute_weight(self._wte, self._cdt)

    def _logits(self, h2, w):                   # (r, C) -> (r, V) float32 under mixed precision
        """The logits: float32 when the compute dtype is lower (the bf16 GEMM's float32 accumulators
        are kept: cross-entropy reads them unrounded, as autocast runs cross-entropy in float32)."""
        return matmul(h2, w.T, np.float32 if self._cdt is not None else None)

    def _dlogits(self, dl):
        """The logits' gradient in the compute dtype, for the two products that read it."""
        return compute_cast(dl, self._cdt)

    def forward(self, inputs):                   # (x (B, T, C), targets (B, T)) -> mean CE
        """Logits and cross-entropy in row chunks of at most CE_CHUNK logits: when the (tokens,
        vocab) logits would be larger, they never exist whole -- the ctx keeps ln_f's output and
        the row log-sum-exp, and backward computes each chunk's logits again."""
        x, targets = inputs
        B, T, C = x.shape
        h, c_ln = self.ln_f.forward(x)
        h2 = h.reshape(B * T, C)
        w = self._w()
        t = xp_of(h2).asarray(targets).reshape(-1)
        N, V = h2.shape[0], w.shape[0]
        n_valid = int((t >= 0).sum())                 # (on a GPU: the step's host syncs)
        rows = self.chunk_rows(N, V)
        if rows >= N:                                 # one chunk: keep the logits for backward
            logits = self._logits(h2, w)              # (N, V)
            loss_rows, lse = kernels.cross_entropy_forward(logits, t)
            return float(loss_rows.sum()) / max(n_valid, 1), (c_ln, h2, logits, lse, t, n_valid, x.shape)
        loss_rows = lse = None
        for r0 in range(0, N, rows):
            r1 = min(r0 + rows, N)
            lr, lc = kernels.cross_entropy_forward(self._logits(h2[r0:r1], w), t[r0:r1])   # (r, V) at a time
            if lse is None:
                loss_rows, lse = xp_of(lr).empty(N, dtype=lr.dtype), xp_of(lc).empty(N, dtype=lc.dtype)
            loss_rows[r0:r1], lse[r0:r1] = lr, lc
        return float(loss_rows.sum()) / max(n_valid, 1), (c_ln, h2, None, lse, t, n_valid, x.shape)

    def forward_backward(self, inputs, dloss, kept=None):
        """forward then backward in one pass, for a caller that has dloss at hand (the loss is this
        micro-batch's last operation): each chunk's logits give their loss and their gradient at
        once, so no logits are computed twice -- the same operations, in the same order, as forward
        followed by backward. Returns (mean CE, dx (B, T, C)); kept (a list, optional) gets what the
        pass holds at its peak beside one chunk (for the activation count; the ledger's head term)."""
        x, targets = inputs
        B, T, C = x.shape
        if self.chunk_rows(B * T, self._wte.data.shape[0]) >= B * T:
            # one chunk: forward keeps the logits and backward turns them into their gradient in place
            return super().forward_backward(inputs, dloss, kept)
        h, c_ln = self.ln_f.forward(x)
        h2 = h.reshape(B * T, C)
        w = self._w()
        xpm = xp_of(h2)
        t = xpm.asarray(targets).reshape(-1)
        N, V = h2.shape[0], w.shape[0]
        n_valid = int((t >= 0).sum())
        scale = dloss / max(n_valid, 1)
        if kept is not None:
            kept.extend((c_ln, h2, t))
        rows = self.chunk_rows(N, V)
        loss_rows = dh = None
        for r0 in range(0, N, rows):
            r1 = min(r0 + rows, N)
            hc, tc = h2[r0:r1], t[r0:r1]
            lg = self._logits(hc, w)                                                  # (r, V)
            lr, lc = kernels.cross_entropy_forward(lg, tc)
            if loss_rows is None:
                loss_rows = xpm.empty(N, dtype=lr.dtype)
                if kept is not None:
                    kept.append(loss_rows)
            loss_rows[r0:r1] = lr                     # summed once, as forward sums them
            dl = self._dlogits(kernels.cross_entropy_backward(lg, lc, tc, scale, out=lg))   # over the logits
            self._chunk_weight_grad(dl, hc)
            dc = matmul(dl, w)                                                        # (r, C)
            if dh is None:                            # the chunk's rows of ln_f's output were read
                same = h2.dtype == dc.dtype and h2.flags.c_contiguous and h2.shape == (N, dc.shape[1])
                dh = h2 if same else xpm.empty((N, dc.shape[1]), dtype=dc.dtype)   # for the last time
            dh[r0:r1] = dc                            # above: d(h) goes over them
        del h, h2, hc, lg, dl, dc                    # the last chunk's logits (up to CE_CHUNK)
        return float(loss_rows.sum()) / max(n_valid, 1), self.ln_f.backward(dh.reshape(x.shape), c_ln)

    def _chunk_weight_grad(self, dl, hc):
        """wte.grad += dl^T hc in vocabulary blocks: no (V, C) product beside the gradient itself
        (the step's first contribution is written straight into the gradient, a later chunk's added
        to it by the GEMM where the library can, matmul(accumulate=True); else through a temporary
        of one block)."""
        fresh = self._wte.write_grad()
        g = fresh if fresh is not None else self._wte.grad
        vrows = max(1, CE_CHUNK // hc.shape[1])
        for v0 in range(0, g.shape[0], vrows):
            matmul(dl[:, v0:v0 + vrows].T, hc, g.dtype, out=g[v0:v0 + vrows], accumulate=fresh is None)   # (v, C)

    def recomputes_logits(self, n_tokens: int) -> bool:
        """Whether forward then backward computes the logits twice (chunked: they are never held
        whole), so that ``forward_backward`` saves one (tokens, C) x (C, V) product."""
        return self.chunk_rows(n_tokens, self._wte.data.shape[0]) < n_tokens

    @staticmethod
    def chunk_rows(N: int, V: int) -> int:
        """Rows per cross-entropy chunk: all N when N x V logits fit in CE_CHUNK elements and N is
        at most CE_ROWS, else the fewest chunks of at most CE_ROWS rows of at most CE_CHUNK logits,
        as even as they go (1024 tokens of a 50k vocabulary: 4 chunks of 256 rows, not 3 of 333
        and one of 25, whose three GEMMs would each read the whole (V, C) embedding for 25 rows)."""
        if N * V <= CE_CHUNK and N <= CE_ROWS:
            return N
        cap = max(1, min(CE_ROWS, CE_CHUNK // V))
        n = -(-N // cap)                              # chunks
        return -(-N // n)

    def backward(self, dloss, ctx):              # dloss: d(total)/d(mean CE) -> dx (B, T, C)
        c_ln, h2, logits, lse, t, n_valid, shape = ctx
        w = self._w()
        scale = dloss / max(n_valid, 1)
        if logits is not None:
            dlogits = self._dlogits(kernels.cross_entropy_backward(logits, lse, t, scale, out=logits))   # (N, V)
            product_grad(self._wte, dlogits.T, h2)                               # (V, C): the W pass
            dh = matmul(dlogits, w)                                               # (N, C)
            return self.ln_f.backward(dh.reshape(shape), c_ln)
        N, V = h2.shape[0], w.shape[0]
        rows = self.chunk_rows(N, V)
        dh = None
        for r0 in range(0, N, rows):
            r1 = min(r0 + rows, N)
            hc = h2[r0:r1]
            lg = self._logits(hc, w)                                                  # (r, V)
            dl = self._dlogits(kernels.cross_entropy_backward(lg, lse[r0:r1], t[r0:r1], scale, out=lg))
            self._chunk_weight_grad(dl, hc)
            dc = matmul(dl, w)                                                    # (r, C)
            if dh is None:
                dh = xp_of(dc).empty((N, dc.shape[1]), dtype=dc.dtype)
            dh[r0:r1] = dc
        return self.ln_f.backward(dh.reshape(shape), c_ln)


# logits elements per cross-entropy chunk (64 MiB in float32; their gradient is written over them):
# a 50k vocabulary at 1024 tokens would be 200 MiB of logits and as much again of their gradient
CE_CHUNK = 1 << 24
# and rows per chunk (the MLP's block, layers.MLP_ROWS): a small vocabulary's logits are small, but
# one chunk of a long sequence held them, their gradient's product and ln_f's dx for every token at
# once (5C per token at a 256 vocabulary and C=128, the step's peak at T=4096)
CE_ROWS = MLP_ROWS


class GPTParts:
    """The three kinds of pieces a GPT is made of, in master ``dtype`` and optional ``compute_dtype``:

      embedding(config, seed)          -> module with .wte (the tied Parameter); forward(idx) -> x
      block(config, i, seed)           -> block i (name transformer.h.{i}); forward(x) -> (y, ctx),
                                          ctx["aux_loss"] for MoE blocks; backward(dy, ctx, scale)
      head(config, embedding, seed)    -> ln_f + lm_head tied to embedding.wte + mean CE;
                                          forward((x, targets)) -> (ce, ctx); backward(scale, ctx)
      activation_shape(config, B, T)   -> the shape of x between blocks

    These are pympar.nn's dense or MoE pieces. A parallelism that splits a piece supplies its own
    parts with the same contract (parallel.tp.TPParts), and ``GPT`` and the pipeline's stages
    (parallel.pp) are built from whichever parts they are given."""

    def __init__(self, dtype=np.float32, compute_dtype=None, model: str = "GPT"):
        self.dtype, self.compute_dtype = resolve_precision(dtype, compute_dtype, model)

    def embedding(self, config, seed):
        return Embedding(config.vocab_size, config.block_size, config.n_embd, seed=seed, dtype=self.dtype,
                         compute_dtype=self.compute_dtype)

    def block(self, config, i, seed):
        return Block(config, i, seed=seed, dtype=self.dtype, compute_dtype=self.compute_dtype)

    def head(self, config, embedding, seed):
        return Head(config, embedding.wte, dtype=self.dtype, compute_dtype=self.compute_dtype)

    def activation_shape(self, config, B, T):
        return (B, T, config.n_embd)


class GradReadyHooks:
    """The backward's "gradients ready" notifications: one protocol for every model (nn.GPT,
    TPGPT, parallel.pp.PipelineGPT). ``grad_ready_hooks``: callbacks ``h(params)`` told which
    parameters' gradients are final for this micro-batch (data parallelism starts their bucket's
    reduction then), and ``h(params, partial=True)`` told that they hold a complete PART of it (the
    head's share of the tied wte: a sync that adds up what it reduces may take it now). The
    gradients that are completed after the backward (``later_grad_ids``: sequence-parallel
    partials summed over tp, a tied weight summed over the pipeline's ends) are left out until
    ``notify_grad_ready(..., final=True)`` says they are done."""
    grad_ready_hooks: list

    def later_grad_ids(self):
        """ids of the parameters whose gradient is completed after the backward (none here)."""
        return ()

    def notify_grad_ready(self, params, *, partial=False, final=False):
        hooks = self.grad_ready_hooks
        if not hooks:
            return
        later = () if final else self.later_grad_ids()
        params = [p for p in params if id(p) not in later]
        if params:
            for hook in hooks:
                hook(params, partial=True) if partial else hook(params)

    def notify_module_ready(self, module):
        """module's gradients are done for this micro-batch (as a backward passes it)."""
        if self.grad_ready_hooks:
            self.notify_grad_ready(module.parameters())


class GPT(Module, MoEBookkeeping, GradReadyHooks):
    """The model: the embedding, blocks and head made of ``parts``. A pipeline stage is a GPT too,
    holding some of the pieces (parallel.pp): ``blocks`` (the block indices it holds, None: all),
    ``embedding`` (it holds the first piece) and ``head`` (the last; ``tied``: the embedding its
    lm_head ties to when it holds no embedding of its own: the last stage's copy of wte), with
    ``stage`` its global stage index. Parameters keep their global names either way. A whole GPT
    trains with ``loss_and_grad``; a stage runs ``stage_forward`` / ``stage_backward`` as the
    pipeline's schedule orders them."""

    def __init__(self, config: GPTConfig, seed: int = 0, dtype=np.float32, compute_dtype=None, *,
                 parts: GPTParts | None = None, blocks=None, embedding: bool = True, head: bool = True,
                 tied=None, stage: int = 0):
        """parts: what the embedding, blocks and head are made of (GPTParts: pympar.nn's, in
        ``dtype`` and ``compute_dtype``, which are then not used; a parallelism's parts split them)."""
        self.config = config.validate()
        parts = parts if parts is not None else GPTParts(dtype, compute_dtype)
        self.dtype, self.compute_dtype = parts.dtype, parts.compute_dtype
        c = config
        self.stage = stage
        self.block_ids = list(range(c.n_layer)) if blocks is None else list(blocks)
        self.embedding = parts.embedding(c, seed) if embedding else None
        self.h = [parts.block(c, i, seed) for i in self.block_ids]
        if head and self.embedding is None and tied is None:
            raise ValueError("a GPT holding the head without the embedding needs tied= (the embedding its lm_head "
                             "ties to)")
        self.head = parts.head(c, self.embedding if self.embedding is not None else tied, seed) if head else None
        self.whole = embedding and head and self.block_ids == list(range(c.n_layer))
        # callbacks h(params) told, during loss_and_grad's backward, which parameters' grads are
        # final for this micro-batch (data parallelism starts their bucket's allreduce early)
        self.grad_ready_hooks = []
        self.param_gather = NoGather()           # ZeRO-3 replaces it (parallel.zero.ParamGather)

    def pieces(self):
        """The modules of one forward in order (ZeRO-3 gathers each one's parameters)."""
        return [m for m in (self.embedding, *self.h, self.head) if m is not None]

    # --- parameters and state ------------------------------------------------------------
    def named_parameters(self, prefix=""):
        """(global name, Parameter) of the pieces held (not the lm_head: it is wte)."""
        if self.embedding is not None:
            yield from self.embedding.named_parameters("transformer")
        for i, b in zip(self.block_ids, self.h):
            yield from b.named_parameters(f"transformer.h.{i}")
        if self.head is not None:
            yield from self.head.ln_f.named_parameters("transformer.ln_f")

    def moe_layers(self):
        """(global block index, MoE) of the MoE blocks held."""
        return [(i, b.moe) for i, b in zip(self.block_ids, self.h) if hasattr(b, "moe")]

    def state_dict(self):
        """nanoGPT names -> numpy copies (no lm_head.weight; MoE selection biases included)."""
        d = {n: np.array(to_numpy(p.data)) for n, p in self.named_parameters()}
        for i, m in self.moe_layers():
            d[f"transformer.h.{i}.moe.expert_bias"] = np.array(to_numpy(m.expert_bias))
        return d

    def load_state_dict(self, d):
        d = dict(d)
        own = dict(self.named_parameters())
        if "lm_head.weight" in d:
            lm = np.asarray(d.pop("lm_head.weight"))
            if not np.array_equal(lm, np.asarray(d.get("transformer.wte.weight"))):
                raise ValueError("lm_head.weight differs from transformer.wte.weight: pympar ties them")
        biases = {f"transformer.h.{i}.moe.expert_bias": m for i, m in self.moe_layers()}
        missing = sorted(set(own) - set(d))
        unexpected = sorted(set(d) - set(own) - set(biases))
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for n, p in own.items():
            a = to_numpy(d[n])
            if a.shape != p.data.shape:
                raise ValueError(f"{n}: shape {a.shape} in the state dict, model has {p.data.shape}")
            p.data[...] = xp_of(p.data).asarray(a)
        for n, m in biases.items():
            if n in d:
                m.expert_bias[...] = xp_of(m.expert_bias).asarray(to_numpy(d[n]))

    # --- forward / backward ----------------------------------------------------------------
    def _inputs(self, *arrays):
        """Token arrays on the parameters' device (host batches are copied to a GPU model)."""
        if not self.whole:
            raise ValueError(f"this GPT is pipeline stage {self.stage} (blocks {self.block_ids}); the whole-model "
                             f"calls need every piece: run it with stage_forward / stage_backward")
        xp = xp_of(self.embedding.wte.data)
        return [xp.asarray(a) for a in arrays]

    def _body(self, idx, trace=None):            # embedding and blocks: idx (B, T) -> x (B, T, C)
        g = self.param_gather
        with g.use(self.embedding), _span(trace, "fwd embedding"):
            x, c_emb = self.embedding.forward(idx)
        ctxs, aux = [], 0.0
        for i, b in enumerate(self.h):
            with g.use(b), _span(trace, f"fwd h.{i}"):
                x, c = b.forward(x)
            ctxs.append(c)
            aux += c["aux_loss"]
        return x, aux, c_emb, ctxs

    def _forward(self, idx, targets):
        x, aux, c_emb, ctxs = self._body(idx)
        with self.param_gather.use(self.head):
            ce, c_head = self.head.forward((x, targets))
        return ce, aux, (c_emb, ctxs, c_head)

    def loss_and_grad(self, idx, targets, grad_scale=1.0, stats=None, trace=None) -> float:
        """One micro-batch: loss = mean CE + MoE aux + z; grads of grad_scale * loss accumulate.
        stats (a dict, optional) gets "activation_bytes": what forward kept for backward (each
        buffer once), the largest over the calls that filled it. trace (optional): label ->
        context manager around each piece's work ("fwd h.3", "fwd+bwd head", "bwd embedding"; the
        runner's profiler passes its recorder's spans)."""
        with compute_copies():                   # each weight cast to the compute dtype once
            idx, targets = self._inputs(idx, targets)
            g = self.param_gather
            x, aux, c_emb, ctxs = self._body(idx, trace)
            with g.use(self.head, backward=True), _span(trace, "fwd+bwd head"):   # forward and backward in one use
                held = [] if stats is not None else None
                ce, dx = self.head.forward_backward((x, targets), grad_scale, held)
                del x
                if stats is not None:
                    kept = held_bytes(idx, c_emb, ctxs, held)
                    stats["activation_bytes"] = max(stats.get("activation_bytes", 0), kept)
            self.notify_module_ready(self.head.ln_f)  # not the tied wte: the embedding adds to it last,
            self.notify_grad_ready([self.head.wte], partial=True)   # but a sync that sums per use may take this part now
            for i in reversed(range(len(self.h))):
                b, c = self.h[i], ctxs.pop()         # each block's activations go as its backward ends
                with g.use(b, backward=True), _span(trace, f"bwd h.{i}"):
                    dx = b.backward(dx, c, grad_scale)
                del c
                self.notify_module_ready(b)
            with g.use(self.embedding, backward=True), _span(trace, "bwd embedding"):
                self.embedding.backward(dx, c_emb)
            self.notify_module_ready(self.embedding)
            g.settle()
            return ce + aux

    # --- a pipeline stage's forward and backward (parallel.pp's executor calls these) -----------
    def head_fuses(self, n_tokens: int) -> bool:
        """Whether the head would compute its logits twice (forward, then backward) for a
        micro-batch of n_tokens, and its one pass (``stage_forward(..., grad_scale=)``) saves that."""
        saves = getattr(self.head, "recomputes_logits", None)    # None: no head, or one that never recomputes
        return saves is not None and saves(n_tokens)

    def stage_forward(self, x, targets=None, grad_scale=None):
        """x: token ids (B, T) when this stage holds the embedding, else activations (B, T, C).

        Returns (y, ctx, loss_terms): y (B, T, C), or None when it holds the head; loss_terms the
        stage's share of this micro-batch's loss (MoE aux + z of its blocks, and CE with the head).
        grad_scale (with the head only; the executor passes it when this micro-batch's backward
        follows at once): the head runs forward and backward in one pass (``Head.forward_backward``:
        its chunks' logits are computed once, not again in backward), its weight gradients are
        added now and the ctx keeps only its input gradient, which ``stage_backward`` hands on."""
        g = self.param_gather
        ctx = {"blocks": []}
        if self.embedding is not None:
            with g.use(self.embedding):
                x, ctx["emb"] = self.embedding.forward(x)
        terms = 0.0
        for b in self.h:
            with g.use(b):
                x, c = b.forward(x)
            ctx["blocks"].append(c)
            terms += float(c.get("aux_loss", 0.0)) if isinstance(c, dict) else 0.0
        if self.head is not None:
            with g.use(self.head):
                if grad_scale is None:
                    ce, ctx["head"] = self.head.forward((x, targets))
                else:
                    ce, ctx["head_dx"] = self.head.forward_backward((x, targets), grad_scale)
            g.settle()
            return None, ctx, terms + float(ce)
        g.settle()
        return x, ctx, terms

    def stage_backward(self, dy, ctx, grad_scale, ready=None):
        """dy (B, T, C) from the next stage (None with the head); returns dx (None with the
        embedding). ready(module), if given, is called as each piece's parameter grads are done
        (the head's ln_f, each block, the embedding), as loss_and_grad notifies."""
        g = self.param_gather
        if self.head is not None:
            if "head_dx" in ctx:                 # forward ran the head's backward too
                dy = ctx.pop("head_dx")
            else:
                with g.use(self.head, backward=True):
                    dy = self.head.backward(grad_scale, ctx.pop("head"))
            if ready is not None:
                ready(self.head.ln_f)
        kept = ctx["blocks"]
        for b in reversed(self.h):
            c = kept.pop()                       # each block's activations go as its backward ends
            with g.use(b, backward=True):
                dy = b.backward(dy, c, grad_scale)
            del c
            if ready is not None:
                ready(b)
        if self.embedding is not None:
            with g.use(self.embedding, backward=True):
                self.embedding.backward(dy, ctx["emb"])
            if ready is not None:
                ready(self.embedding)
            g.settle()
            return None
        g.settle()
        return dy

    def stage_backward_input(self, dy, ctx, grad_scale):
        """The B pass of a zero-bubble schedule: ``stage_backward`` with every weight gradient that
        can wait deferred; returns (dx, WeightGrads). ``WeightGrads.run()`` is the W pass: the same
        gradients, bitwise, as ``stage_backward`` would have added (LayerNorm's, computed by the
        kernel that computes its dx, are added in B)."""
        with WeightGrads() as w:
            dx = self.stage_backward(dy, ctx, grad_scale)
        return dx, w

    def forward_loss(self, idx, targets) -> float:
        """The same loss without gradients (and without counting expert loads)."""
        layers = [m for _, m in self.moe_layers()]
        for m in layers:
            m.recording = False
        try:
            ce, aux, _ = self._forward(*self._inputs(idx, targets))
        finally:
            for m in layers:
                m.recording = True
            self.param_gather.settle()
        return ce + aux

    def logits(self, idx):                       # idx (B, T) -> (B, T, V) in the compute dtype
        layers = [m for _, m in self.moe_layers()]
        for m in layers:
            m.recording = False
        try:
            x, _, _, _ = self._body(*self._inputs(idx))
            with self.param_gather.use(self.head):
                return self.head.logits(x)
        finally:
            for m in layers:
                m.recording = True
            self.param_gather.settle()

    def generate(self, idx, n, top_k=None, rng=None, temperature=1.0):
        """Append n sampled tokens to idx (B, T)."""
        from .generate import sample        # the one sampling rule (the cached path uses it too)

        rng = np.random.default_rng(0) if rng is None else rng
        idx = to_numpy(idx)                      # sampling runs on the host
        for _ in range(n):
            ctx = idx[:, -self.config.block_size:]
            nxt = sample(self.logits(ctx)[:, -1, :], top_k, temperature, rng)
            idx = np.concatenate([idx, nxt], axis=1)
        return idx

