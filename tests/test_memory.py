"""Memory by placement, without MPI: what a rank makes is what it holds, recomputation changes
no number, and the ledger's prediction equals what the modules keep.

Allocations are traced with tracemalloc (NumPy reports its data buffers to it), so "made" is
every byte NumPy allocated while building and first touching a rank's parameters."""
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from pympar import kernels
from pympar.nn import GPT, GPTConfig
from pympar.nn.attention_core import CausalAttentionCore
from pympar.nn.gpt import set_recompute
from pympar.nn.init import BLOCK
from pympar.parallel import ledger
from pympar.parallel.dp import DataParallel
from pympar.parallel.ep import install_expert_parallel
from pympar.parallel.pp import PipelineGPT
from pympar.parallel.shard import make_sharded
from pympar.parallel.tp import TPGPT, TPParts

# sizes chosen so that a rank's share plus the scratch stays well below the whole model: a rank
# that made the full tensors (or other stages' or experts') would exceed the bounds below
CFG = GPTConfig(vocab_size=1024, block_size=32, n_layer=8, n_head=4, n_embd=128)
MOE = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=128, n_expert=8, top_k=2)
SCRATCH = 16 * BLOCK * 8                # nn.init's float64 temporaries for one block of elements


class FakeComm:
    """A rank of a group of ``size``: construction only asks for rank and size."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def made_while(fn):
    """(result, peak bytes NumPy allocated while fn ran)."""
    tracemalloc.start()
    try:
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


def touch(params):
    """Make every parameter (first use) and return the bytes they hold."""
    return sum(p.data.nbytes for p in params)


def test_a_shard_is_made_without_the_full_tensor():
    full_shape = (4096, 1024)                                  # 16 MiB in float32
    def make():
        p = make_sharded(0, "transformer.h.0.mlp.c_fc.weight", full_shape, (slice(1024, 1536), slice(None)))
        return p, p.data
    (p, data), peak = made_while(make)
    assert data.shape == (512, 1024)
    assert peak < data.nbytes + SCRATCH < 4096 * 1024 * 4 / 2, peak


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_a_pipeline_rank_makes_only_its_stages(rank):
    """pp=4 over the 8 blocks: each rank makes its blocks (+ embeddings first, ln_f and the tied
    head copy last), with pympar.nn's parts and with tensor-parallel ones (tp.TPParts over a
    one-rank group)."""
    for factory in (None, TPParts(FakeComm(0, 1))):
        model, peak = made_while(lambda: (m := PipelineGPT(CFG, 0, pp=4, rank=rank, factory=factory), touch(m.parameters()))[0])
        held = sum(p.data.nbytes for p in model.parameters())
        n = ledger.params_per_rank(CFG, 1, 1, [2 * rank, 2 * rank + 1], rank == 0, rank == 3)
        assert held == 4 * n
        assert peak < held + SCRATCH, (rank, peak, held)


def test_a_tensor_parallel_rank_makes_only_its_shards():
    model, peak = made_while(lambda: (m := TPGPT(CFG, FakeComm(1, 4), seed=0), touch(m.parameters()))[0])
    held = sum(p.data.nbytes for p in model.parameters())
    assert held == 4 * ledger.params_per_rank(CFG, 4, 1, range(CFG.n_layer), True, True)
    assert held < 0.4 * 4 * sum(int(np.prod(p.shape)) for p in GPT(CFG).parameters())
    assert peak < held + SCRATCH


def test_an_expert_parallel_rank_makes_only_its_experts():
    def build():
        m = install_expert_parallel(GPT(MOE, seed=0), FakeComm(1, 4))
        touch(m.parameters())
        return m
    model, peak = made_while(build)
    names = [n for n, _ in model.named_parameters()]
    assert any(".experts.2." in n for n in names) and not any(".experts.0." in n for n in names)
    held = sum(p.data.nbytes for p in model.parameters())
    assert held == 4 * ledger.params_per_rank(MOE, 1, 4, range(MOE.n_layer), True, True)
    assert peak < held + SCRATCH


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_persistent_bytes_are_the_ledgers(zero):
    """Parameters, gradient storage and optimizer state a rank of dp=4 holds, against the ledger's
    prediction (padding rows aside); ZeRO-3 makes only its rows of the parameters."""
    dp = 4
    for r in range(dp):
        named = list(GPT(CFG, seed=1).named_parameters())
        d, peak = made_while(lambda: DataParallel(named, FakeComm(r, dp), zero=zero))   # builds, no collective
        opt = d.make_optimizer()
        sync = SimpleNamespace(syncs=[d])
        got = ledger.measure(sync, opt, [p for _, p in named], 0, 0, 0)
        want, _ = ledger.predict(CFG, dp=dp, zero=zero)
        pad = sum(len(b.params) for b in d.buckets) * 4 * CFG.n_embd * 4    # < one row of each parameter
        for k in ("parameters", "optimizer"):
            assert abs(got[k] - want[k]) <= 2 * pad, (k, got[k], want[k])
        if zero == 3:
            assert peak < got["parameters"] + SCRATCH + pad   # the full tensors were never made


def _grads_after(cfg, mode, dtype=np.float64):
    model = set_recompute(GPT(cfg, seed=2, dtype=dtype), mode)
    rng = np.random.default_rng(0)
    stats = {}
    loss = 0.0
    for _ in range(2):
        x = rng.integers(0, cfg.vocab_size, size=(2, cfg.block_size + 1))
        loss += model.loss_and_grad(x[:, :-1], x[:, 1:], grad_scale=0.5, stats=stats)
    return loss, {n: p.grad.copy() for n, p in model.named_parameters()}, stats["activation_bytes"], model


IMPLS = ["tiled", "materialized"]


@pytest.fixture(params=IMPLS)
def attention_impl(request, monkeypatch):
    """Attention through the tiled kernel or the materialized reference path."""
    if request.param == "tiled" and not kernels.native_available():
        pytest.skip("the tiled attention kernel needs the C++ kernels")
    monkeypatch.setattr(CausalAttentionCore, "impl", request.param)
    return request.param


@pytest.mark.parametrize("rows", [None, 7], ids=["one-block", "blocks-of-7"])
@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_recomputation_is_bitwise_the_same(cfg, attention_impl, rows, monkeypatch):
    """Each mode gives the gradients of 'none' bit for bit, the MLP in one block or (rows=7) in
    uneven blocks of 7 tokens; 'selective' keeps exactly a dense MLP's hidden layers less (and the
    materialized path's probabilities), 'full' less still."""
    from pympar.nn import layers
    if rows:
        monkeypatch.setattr(layers, "MLP_ROWS", rows)
    loss, grads, keep, model = _grads_after(cfg, "none")
    loads = [s["tokens_per_expert"] for s in model.moe_stats()]
    hidden = sum(2 * cfg.block_size * 4 * cfg.n_embd * 8 for i in range(cfg.n_layer) if not cfg.is_moe_block(i))
    for mode in ("selective", "full"):
        l2, g2, keep2, m2 = _grads_after(cfg, mode)
        assert l2 == loss
        for n in grads:
            np.testing.assert_array_equal(g2[n], grads[n], err_msg=f"{mode} {n}")
        if mode == "selective" and attention_impl == "tiled":
            assert keep2 == keep - hidden                      # no probabilities were kept to drop
        else:
            assert keep2 < keep - hidden
        if cfg.n_expert:                                       # loads counted once, not per recompute
            assert [s["tokens_per_expert"] for s in m2.moe_stats()] == loads


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_ledger_activations_are_what_forward_keeps(mode, attention_impl):
    """The planner's activation bytes equal what the modules' ctxs hold (dense: to 0.1%, the token
    ids being a view of the caller's batch; MoE: its routing-dependent rows within 10%)."""
    for cfg, tol in ((CFG, 1e-3), (MOE, 0.10)):
        _, _, kept, _ = _grads_after(cfg, mode, np.float32)
        want = ledger.activations_per_micro(cfg, 2, cfg.block_size, 1, False, mode, range(cfg.n_layer), True,
                                            True, 4, 4, tiled=attention_impl == "tiled")
        assert abs(kept - want) <= tol * want, (cfg.n_expert, mode, kept, want)


def test_full_recomputation_cuts_a_12_layer_models_activations_4x():
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=12, n_head=4, n_embd=32)
    _, _, none, _ = _grads_after(cfg, "none", np.float32)
    _, _, full, _ = _grads_after(cfg, "full", np.float32)
    assert none >= 4 * full, (none, full)


def test_chunked_cross_entropy_equals_the_whole_one(monkeypatch):
    """Logits in row chunks (a vocabulary too large to hold them whole): the same loss and
    gradients as the one-chunk head to float64 rounding, and the logits never kept."""
    import pympar.nn.gpt as G

    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=1, n_head=2, n_embd=16)
    whole, gw, kept_whole, _ = _grads_after(cfg, "none")
    monkeypatch.setattr(G, "CE_CHUNK", 7 * cfg.vocab_size)          # 7 rows per chunk, uneven
    assert G.Head.chunk_rows(2 * cfg.block_size, cfg.vocab_size) == 7
    chunked, gc, kept_chunked, _ = _grads_after(cfg, "none")
    assert chunked == pytest.approx(whole, rel=1e-13)
    for n in gw:
        np.testing.assert_allclose(gc[n], gw[n], rtol=1e-10, atol=1e-14, err_msg=n)
    logits = 2 * cfg.block_size * cfg.vocab_size * 8
    assert kept_whole - kept_chunked == logits


def test_a_long_sequence_head_holds_one_chunk_of_logits_whatever_the_vocabulary():
    """A small vocabulary's logits are small per token, not per sequence: over more than CE_ROWS
    tokens the head runs in chunks of CE_ROWS rows (a 50k vocabulary's CE_CHUNK bound is the
    smaller one), and its one pass writes ln_f's output gradient over ln_f's output. What the pass
    allocates is then that (N, C) array, ln_f's dx and one chunk's logits -- not the (N, V)
    logits (8C per token here) that one chunk of 4096 rows held."""
    import pympar.nn.gpt as G
    assert G.Head.chunk_rows(G.CE_ROWS, 256) == G.CE_ROWS            # one chunk, logits kept
    assert G.Head.chunk_rows(4 * G.CE_ROWS, 256) == G.CE_ROWS
    cap = G.CE_CHUNK // 50304                                          # 333 rows of a 50k vocabulary
    assert G.Head.chunk_rows(2048, 50304) == 293                       # 7 chunks (as at 333), even
    assert G.Head.chunk_rows(1024, 50304) == 256 and 256 <= cap        # gpt2-124m: 4 x 256, not 3 x 333 + 25
    assert G.Head.chunk_rows(G.CE_ROWS + 1, 256) == G.CE_ROWS // 2 + 1  # 2 chunks, not CE_ROWS and 1
    N, C, V = 4 * G.CE_ROWS, 32, 256
    cfg = GPTConfig(vocab_size=V, block_size=N, n_layer=1, n_head=2, n_embd=C)
    head = GPT(cfg, seed=2).head
    touch(head.parameters())
    head.wte.grad
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, N, C)).astype(np.float32)
    t = rng.integers(0, V, size=(1, N))
    (loss, dx), peak = made_while(lambda: head.forward_backward((x, t), 1.0))
    one = N * C * 4
    assert np.isfinite(loss) and dx.shape == x.shape
    assert peak <= 2 * one + 2 * G.CE_ROWS * V * 4 + 2**16, (peak / one, 2 * G.CE_ROWS * V * 4 / one)


@pytest.mark.parametrize("rows", [None, 7])
def test_head_forward_backward_is_forward_then_backward_bitwise(monkeypatch, rows):
    """The one-pass head (what loss_and_grad runs) gives the loss, dx and the tied weight's
    gradient of forward followed by backward bit for bit, whole and chunked; chunked, it computes
    each chunk's logits once (ceil(N/rows) logits products, where forward + backward take twice)."""
    import pympar.nn.gpt as G
    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=1, n_head=2, n_embd=16)
    if rows:
        monkeypatch.setattr(G, "CE_CHUNK", rows * cfg.vocab_size)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, cfg.block_size, cfg.n_embd)).astype(np.float32)
    t = rng.integers(0, cfg.vocab_size, size=(2, cfg.block_size))
    t[0, 3] = -1                                                       # an ignored target
    got = []
    for fused in (False, True):
        head = GPT(cfg, seed=4).head
        calls = []
        real = G.matmul
        monkeypatch.setattr(G, "matmul", lambda a, b, *r, **kw: (calls.append(b.shape), real(a, b, *r, **kw))[1])
        if fused:
            loss, dx = head.forward_backward((x, t), 0.5)
        else:
            loss, ctx = head.forward((x, t))
            dx = head.backward(0.5, ctx)
        monkeypatch.setattr(G, "matmul", real)
        logits_products = sum(1 for s in calls if s == (cfg.n_embd, cfg.vocab_size))
        got.append((loss, dx, head.wte.grad.copy(), head.ln_f.weight.grad.copy(), logits_products))
    (l0, d0, g0, w0, n0), (l1, d1, g1, w1, n1) = got
    assert l0 == l1
    for a, b in ((d0, d1), (g0, g1), (w0, w1)):
        np.testing.assert_array_equal(a, b)
    chunks = -(-2 * cfg.block_size // rows) if rows else 1
    assert n1 == chunks and n0 == (2 * chunks if rows else 1)


def _block_and_input(cfg, seed=3):
    from pympar.nn.gpt import Block
    blk = Block(cfg, 0, seed=seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, cfg.block_size, cfg.n_embd)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    return blk, x, dy


@pytest.mark.parametrize("rows", [None, 24], ids=["one-block", "mlp-blocks-of-24"])
def test_a_block_keeps_no_layernorm_output_and_backward_is_bitwise_the_kept_one(rows, monkeypatch):
    """Block's ctx drops ln_1's and ln_2's outputs (computed again in backward from their inputs),
    and the block's MLP and attention core write their outputs and gradients over arrays
    the block owns (consume); dx and every gradient equal bit for bit the composition that keeps
    and allocates them."""
    from pympar.nn import layers
    if rows:
        monkeypatch.setattr(layers, "MLP_ROWS", rows)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
    blk, x, dy = _block_and_input(cfg)
    y, ctx = blk.forward(x)
    assert ctx["attn"][0] is None and ctx["ffn"][0] is None
    dx = blk.backward(dy, ctx)
    got = {n: p.grad.copy() for n, p in blk.named_parameters()}
    blk.zero_grad()
    h1, c1 = blk.ln_1.forward(x)                 # the same modules, every output kept
    a, ca = blk.attn.forward(h1)
    x1 = x + a
    h2, c2 = blk.ln_2.forward(x1)
    f, cf = blk.mlp.forward(h2)
    np.testing.assert_array_equal(y, x1 + f)
    dx1 = blk.ln_2.backward(blk.mlp.backward(dy, cf), c2) + dy
    want_dx = blk.ln_1.backward(blk.attn.backward(dx1, ca), c1) + dx1
    np.testing.assert_array_equal(dx, want_dx)
    for n, p in blk.named_parameters():
        np.testing.assert_array_equal(got[n], p.grad, err_msg=n)


def test_mlp_backward_holds_one_hidden_sized_transient():
    """An MLP's backward allocates one (N, 4C) array (the GELU output, then its gradient over it,
    then GELU's backward in place), not two or three; dx and the gradients as before, bitwise."""
    from pympar.nn.layers import MLP
    from pympar.nn.wgrad import WeightGrads
    N, C = 1024, 64
    mlp = MLP(C, name="m", seed=1)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N, C)).astype(np.float32)
    dy = rng.standard_normal((N, C)).astype(np.float32)
    _, ctx = mlp.forward(x)
    for p in mlp.parameters():
        p.grad                                   # allocated before: not the backward's transient
    dx, peak = made_while(lambda: mlp.backward(dy, ctx))
    hidden = N * 4 * C * 4
    assert peak <= hidden + 2 * N * C * 4 + 4 * C * C * 4 + 2**14, (peak, hidden)
    got = {n: p.grad.copy() for n, p in mlp.named_parameters()}
    mlp.zero_grad()
    with WeightGrads() as w:                     # deferred W (zero-bubble): the GELU output is kept
        dx2 = mlp.backward(dy, ctx)
    w.run()
    np.testing.assert_array_equal(dx, dx2)
    for n, p in mlp.named_parameters():
        np.testing.assert_array_equal(got[n], p.grad, err_msg=n)


@pytest.mark.parametrize("keep_hidden", [True, False])
def test_mlp_in_blocks_equals_one_block_and_holds_a_blocks_transient(keep_hidden, monkeypatch):
    """An MLP over more tokens than MLP_ROWS runs in blocks of them: dx and the gradients equal the
    one-block MLP's to float64 rounding (uneven blocks), forward keeps x and (keep_hidden) the whole
    hidden layer only, and backward's transient is a block's hidden layer and GELU output (plus dx
    and a weight gradient's product), not the sequence's."""
    from pympar.nn import layers
    from pympar.nn.layers import MLP
    N, C, rows = 2000, 32, 300
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, C))
    dy = rng.standard_normal((N, C))
    got = []
    for r in (N, rows):
        monkeypatch.setattr(layers, "MLP_ROWS", r)
        mlp = MLP(C, name="m", seed=4, dtype=np.float64)
        mlp.keep_hidden = keep_hidden
        (y, ctx), fpeak = made_while(lambda: mlp.forward(x))
        # forward: y, (keep_hidden) the whole hidden layer, and one block's pair (h, GELU(h)) at a time
        held = N * C * 8 + (N * 4 * C * 8 if keep_hidden else 0)
        assert fpeak <= held + 2 * min(r, N) * 4 * C * 8 + 2**18, (r, fpeak, held)   # two more blocks: +614 KB
        assert ctx[0] is x and (ctx[1] is None) == (not keep_hidden)
        for p in mlp.parameters():
            p.grad                                   # allocated before: not the backward's transient
        dx, peak = made_while(lambda: mlp.backward(dy, ctx))
        got.append((y, dx, {n: p.grad.copy() for n, p in mlp.named_parameters()}, peak))
    (y0, dx0, g0, peak0), (y1, dx1, g1, peak1) = got
    np.testing.assert_allclose(y1, y0, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-12, atol=1e-14)
    for n in g0:
        np.testing.assert_allclose(g1[n], g0[n], rtol=1e-12, atol=1e-14, err_msg=n)
    H, a = 4 * C, 8
    blocks = (1 if keep_hidden else 2) * rows * H * a
    assert peak1 <= blocks + N * C * a + rows * C * a + 4 * C * C * a + 2**14, (peak1, blocks)
    assert peak0 >= (1 if keep_hidden else 2) * N * H * a                     # one block: the whole sequence's


@pytest.mark.parametrize("keep_hidden", [True, False])
@pytest.mark.parametrize("rows", [None, 300], ids=["one-block", "blocks-of-300"])
def test_mlp_consuming_its_input_writes_over_it_bitwise(keep_hidden, rows, monkeypatch):
    """consume=True (a Block's MLP: its input is ln_2's output, computed again for backward):
    forward writes y over x block by block and backward writes dx over the x it is given, with
    the same bits as the MLP that allocates them; forward then allocates no (N, C) output, only
    (keep_hidden) the hidden layer and one block's pair."""
    from pympar.nn import layers
    from pympar.nn.layers import MLP
    N, C = 2000, 32
    monkeypatch.setattr(layers, "MLP_ROWS", rows or N)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((N, C)).astype(np.float32)
    dy = rng.standard_normal((N, C)).astype(np.float32)
    out = []
    for consume in (False, True):
        mlp = MLP(C, name="m", seed=4)
        mlp.keep_hidden = keep_hidden
        touch(mlp.parameters())                  # made on first use: before, not in forward's peak
        xin = x.copy()
        (y, ctx), fpeak = made_while(lambda: mlp.forward(xin, consume=consume))
        assert np.shares_memory(y, xin) == consume and (ctx[0] is None) == consume
        y = y.copy()
        xb = x.copy()                            # backward's input: ln_2's output again
        dx = mlp.backward(dy, (xb, ctx[1]), consume=consume)
        assert np.shares_memory(dx, xb) == consume
        out.append((y, dx, {n: p.grad.copy() for n, p in mlp.named_parameters()}, fpeak))
    (y0, dx0, g0, _), (y1, dx1, g1, fpeak1) = out
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(dx1, dx0)
    for n in g0:
        np.testing.assert_array_equal(g1[n], g0[n], err_msg=n)
    r = min(rows or N, N)
    held = N * 4 * C * 4 if keep_hidden else 0
    assert fpeak1 <= held + 2 * r * 4 * C * 4 + 2**16, (fpeak1, held)      # y (N C: 256 KB) would not fit


@pytest.mark.parametrize("mode", ["none", "selective"])
@pytest.mark.parametrize("rows", [None, 300], ids=["one-block", "blocks-of-300"])
@pytest.mark.parametrize("deferred", [False, True], ids=["w-now", "w-deferred"])
@pytest.mark.parametrize("consume", [False, True], ids=["new-dx", "dx-over-x"])
def test_ledger_mlp_backward_is_what_the_mlp_allocates(mode, rows, deferred, consume, monkeypatch):
    """The ledger's MLP backward transient (workspace) against what backward allocates (traced):
    within 15% above and 10% below, one block or blocks, W now or deferred (then held until run),
    dx made or written over the input (a Block's backward: consume)."""
    from pympar.nn import layers
    from pympar.nn.layers import MLP
    from pympar.nn.wgrad import WeightGrads
    N, C = 2000, 32
    monkeypatch.setattr(layers, "MLP_ROWS", rows or N)
    mlp = MLP(C, name="m", seed=4)
    mlp.keep_hidden = mode == "none"
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, C)).astype(np.float32)
    dy = rng.standard_normal((N, C)).astype(np.float32)
    _, ctx = mlp.forward(x)
    for p in mlp.parameters():
        p.grad

    def back():
        if not deferred:
            return mlp.backward(dy, ctx, consume=consume), None
        with WeightGrads() as w:
            dx = mlp.backward(dy, ctx, consume=consume)
        return dx, w
    (dx, w), peak = made_while(back)
    assert np.shares_memory(dx, x) == (consume and not deferred)
    want = ledger.mlp_backward_bytes(N, C, 1, mode, deferred, 4, consume=consume)
    assert 0.9 * want <= peak <= 1.15 * want + 4 * C * C * 4, (peak, want)


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_ledger_wgrad_hold_is_what_the_deferred_w_keeps(cfg):
    """A zero-bubble chunk's B pass keeps for its W what ledger.wgrad_hold_per_micro says (dense:
    exactly; MoE: its routing-dependent rows within 10%), first/last stage or middle one, in every
    recomputation mode -- more than the ctx for dense blocks (16C against 10C per token)."""
    from pympar.nn.gpt import GPT, GPTParts
    fac = GPTParts(np.float32)
    tol = 1e-9 if not cfg.n_expert else 0.10
    for first, last in ((True, True), (False, False)):
        chunk = GPT(cfg, 0, parts=fac, blocks=[0, 1], embedding=first, head=last)     # a pipeline stage
        for mode in ("none", "selective", "full"):
            for b in chunk.h:
                set_recompute(b, mode)
            rng = np.random.default_rng(1)
            idx, tgt = rng.integers(0, cfg.vocab_size, size=(2, cfg.block_size)), rng.integers(0, cfg.vocab_size, size=(2, cfg.block_size))
            x = idx if first else rng.standard_normal((2, cfg.block_size, cfg.n_embd)).astype(np.float32)
            _, ctx, _ = chunk.stage_forward(x, tgt if last else None)
            dy = None if last else np.ones((2, cfg.block_size, cfg.n_embd), np.float32)
            _, w = chunk.stage_backward_input(dy, ctx, 0.5)
            want = ledger.wgrad_hold_per_micro(cfg, 2, cfg.block_size, 1, False, [0, 1], last, first, 4, 4)
            assert abs(w.nbytes - want) <= tol * want, (first, last, mode, w.nbytes, want)
            w.run()


def test_selective_leaves_a_tensor_parallel_mlp_its_hidden_layer():
    """set_recompute('selective') drops a dense MLP's hidden layer only where its rows may run
    alone: a tensor-parallel MLP (whose GEMMs are one collective over all rows) keeps it, and a
    plain MLP does not; 'none' gives both back."""
    from pympar.comm import SelfComm
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    tp = set_recompute(TPGPT(cfg, SelfComm()), "selective")
    plain = set_recompute(GPT(cfg), "selective")
    assert all(b.mlp.keep_hidden for b in tp.h)
    assert not any(b.mlp.keep_hidden for b in plain.h)
    set_recompute(plain, "none")
    assert all(b.mlp.keep_hidden for b in plain.h)


def test_available_memory_is_meminfo_or_a_cgroups_room_whichever_is_smallest(tmp_path):
    """The trainer's --memory-check compares with ledger.available_memory: this node's MemAvailable, and
    the least room of the process's memory cgroup and its ancestors (limit less use less the
    reclaimable file pages), found where /proc/self/cgroup places it -- v2 and v1 files, as the kernel
    writes them, under a root of their own."""
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert 0 <= ledger.available_memory() <= total          # 0: a cgroup at its limit
    assert ledger.available_memory(str(tmp_path)) is None                 # nothing to read
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:       16777216 kB\nMemAvailable:    8388608 kB\n")
    assert ledger.available_memory(str(tmp_path)) == 8 << 30

    def group(d, limit, usage, stat):
        d.mkdir(parents=True, exist_ok=True)
        for name, v in zip(limit_usage, (limit, usage)):
            (d / name).write_text(f"{v}\n")
        (d / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in stat.items()))

    # v2: a batch job's cgroup (no limit of its own) under a slice with 1 GiB: the slice's room counts
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/job.slice/step_0\n")
    v2 = tmp_path / "sys" / "fs" / "cgroup"
    limit_usage = ("memory.max", "memory.current")
    group(v2 / "job.slice" / "step_0", "max", 100 << 20, {"inactive_file": 0})
    group(v2 / "job.slice", 1 << 30, 600 << 20, {"anon": 500 << 20, "active_file": 60 << 20,
                                                   "inactive_file": 40 << 20})
    assert ledger.available_memory(str(tmp_path)) == (1 << 30) - (500 << 20)
    group(v2 / "job.slice" / "step_0", 512 << 20, 400 << 20, {"inactive_file": 0})   # a tighter own limit
    assert ledger.available_memory(str(tmp_path)) == 112 << 20
    group(v2 / "job.slice" / "step_0", 512 << 20, 600 << 20, {"inactive_file": 0})   # at its limit: no room
    assert ledger.available_memory(str(tmp_path)) == 0
    for d in (v2 / "job.slice" / "step_0", v2 / "job.slice"):
        for f in d.iterdir():
            if f.is_file():
                f.unlink()
    assert ledger.available_memory(str(tmp_path)) == 8 << 30             # v2 without limits
    # v1: the memory controller's line; a container's namespace shows "/" (its own group at the mount)
    (tmp_path / "proc" / "self" / "cgroup").write_text("4:memory:/\n0::/\n")
    limit_usage = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    group(v2 / "memory", 3 << 30, 2 << 30, {"cache": 1 << 30, "total_active_file": 256 << 20,
                                           "total_inactive_file": 256 << 20})
    assert ledger.available_memory(str(tmp_path)) == (3 << 30) - (2 << 30) + (512 << 20)
    (v2 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")      # v1 without a limit
    assert ledger.available_memory(str(tmp_path)) == 8 << 30
