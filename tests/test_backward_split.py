"""The backward split of zero-bubble pipelines: ``backward_input`` (the input gradient) then
``backward_weight`` (the weight gradients it deferred) gives bitwise the gradients of
``backward``, for every module kind, dense and MoE, in float32 and float64, under tensor
parallelism on a size-1 group too; the deferred part is really deferred (no weight gradient
moves before ``backward_weight``) and what it keeps is freed by it. ``backward`` itself is
checked against finite differences in tests/test_nn_layers.py and test_nn_gpt.py, so bitwise
equality carries that check over."""
import numpy as np
import pytest

from pympar.comm import SelfComm
from pympar.nn import MLP, CausalSelfAttention, GPTConfig, LayerNorm, Linear
from pympar.nn.gpt import Block, Head
from pympar.nn.layers import Embedding
from pympar.nn.moe import MoE
from pympar.nn.wgrad import WeightGrads
from pympar.nn.gpt import GPT, GPTParts
from pympar.parallel.tp.block import TPBlock

C, T, B = 16, 7, 3
MOE = dict(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=C, n_expert=4, top_k=2, moe_every=1)


def _modules(dt, cdt=None):
    """Every module kind in master dtype dt (compute dtype cdt: bf16 activations, float32 weights)."""
    cfg = GPTConfig(**MOE)
    dense = GPTConfig(**{**MOE, "n_expert": 0})
    mk = dict(dtype=dt, compute_dtype=cdt)
    emb = Embedding(29, 8, C, **mk)
    yield "linear", Linear(C, 2 * C, name="l", **mk), "x"
    yield "linear-nobias", Linear(C, C, name="l", bias=False, **mk), "x"
    yield "layernorm", LayerNorm(C, name="ln", **mk), "x"
    yield "mlp", MLP(C, name="m", **mk), "x"
    mlp = MLP(C, name="m", **mk)
    mlp.keep_hidden = False                        # the hidden layer computed again in backward
    yield "mlp-recomputed-hidden", mlp, "x"
    yield "attention", CausalSelfAttention(C, 2, name="a", **mk), "x"
    yield "moe", MoE(C, 4, name="e", top_k=2, capacity_factor=1.0, **mk), "x"
    yield "block-dense", Block(dense, 0, **mk), "x"
    yield "block-moe", Block(cfg, 0, **mk), "x"
    yield "tp-block-moe", TPBlock(cfg, 1, SelfComm(), **mk), "x"
    yield "embedding", emb, "idx"
    yield "head", Head(dense, emb.wte, **mk), "head"


def _inputs(kind, dt, rng):
    if kind == "idx":
        return rng.integers(0, 29, size=(B, T))
    x = rng.standard_normal((B, T, C)).astype(dt)
    if kind == "head":
        return (x, rng.integers(0, 29, size=(B, T)))
    return x


def _grads(m):
    return {n: p.grad.copy() for n, p in m.named_parameters()}


def _backward(m, dy, ctx, split):
    if isinstance(m, Head):
        dy = 0.7                                   # d(total)/d(mean CE)
    args = (0.3,) if isinstance(m, (MoE, Block)) else ()
    if not split:
        return m.backward(dy, ctx, *args)
    before = _grads(m)
    dx = m.backward_input(dy, ctx, *args)
    ln = {id(p) for mod in m.modules() if isinstance(mod, LayerNorm) for p in mod.parameters()}   # added in B
    moved = [n for n, p in m.named_parameters() if id(p) not in ln and not np.array_equal(p.grad, before[n])]
    assert not moved, f"weight gradients changed before backward_weight: {moved}"
    m.backward_weight(ctx)
    return dx


@pytest.mark.parametrize("rows", [None, 5], ids=["mlp-one-block", "mlp-blocks-of-5"])
@pytest.mark.parametrize("dt", [np.float32, np.float64, "bfloat16"])
def test_backward_input_then_weight_is_backward_bitwise(dt, rows, monkeypatch):
    """(rows=5: the MLPs run the 21 tokens in uneven blocks of 5, the deferred W passes too;
    "bfloat16": float32 master weights, bf16 activations and products.)"""
    from pympar.backend import dtype as resolve
    from pympar.nn import layers
    if rows:
        monkeypatch.setattr(layers, "MLP_ROWS", rows)
    cdt = resolve(dt) if dt == "bfloat16" else None
    master, act = (np.float32, cdt) if cdt is not None else (dt, dt)
    for name, m, kind in _modules(master, cdt):
        outs = []
        for split in (False, True):
            rng = np.random.default_rng(5)
            x = _inputs(kind, act, rng)
            m.zero_grad()
            y, ctx = m.forward(x)
            dy = rng.standard_normal(np.shape(y)).astype(np.float32).astype(act) if not np.isscalar(y) else None
            dx = _backward(m, dy, ctx, split)
            outs.append((dx, _grads(m)))
        (dx0, g0), (dx1, g1) = outs
        assert (dx0 is None and dx1 is None) or np.array_equal(dx0, dx1), name
        assert g0.keys() == g1.keys()
        for n in g0:
            assert np.array_equal(g0[n], g1[n]), (name, n)
        assert any(np.any(g) for g in g1.values()), name      # the comparison saw real gradients


def test_stage_chunk_split_keeps_what_w_needs_and_frees_it():
    """A pipeline chunk's B pass returns the deferred W (its bytes counted), the W pass adds the
    same gradients as the unsplit backward, and running it empties it."""
    cfg = GPTConfig(**MOE)
    chunk = GPT(cfg, 0, parts=GPTParts(np.float64), blocks=[0, 1])     # a pipeline stage holding every piece
    rng = np.random.default_rng(1)
    idx, tgt = rng.integers(0, 29, size=(2, 8)), rng.integers(0, 29, size=(2, 8))
    params = [p for _, p in chunk.named_parameters()]
    got = []
    for split in (False, True):
        for p in params:
            p.zero_grad()
        _, ctx, _ = chunk.stage_forward(idx, tgt)
        if split:
            dx, w = chunk.stage_backward_input(None, ctx, 0.5)
            assert isinstance(w, WeightGrads) and w.items and w.nbytes > 0
            w.run()
            assert not w.items
        else:
            dx = chunk.stage_backward(None, ctx, 0.5)
        assert dx is None
        got.append([p.grad.copy() for p in params])
    for a, b in zip(*got):
        assert np.array_equal(a, b)
