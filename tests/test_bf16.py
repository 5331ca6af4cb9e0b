"""bfloat16 compute (issue 43): the bf16 kernels, the bf16 products on every engine this machine
has (pympar's AMX tiles and AVX512-BF16 dot products, MKL's cblas_gemm_bf16bf16f32, the float32
fallback), the model against
float64 and against PyTorch autocast, and the engine choice.

Bounds, derived rather than fitted:
- a bf16 kernel runs the float32 kernel's formula on its widened inputs and rounds each output once
  (csrc/lowp.cpp), so it must equal that kernel's float32 result rounded to bf16, bit for bit;
- a product of bf16 numbers is exact in float32 (8 + 8 significant bits), so a bf16 GEMM with
  float32 accumulation over K terms is within gamma_K = K u / (1 - K u), u = 2^-24, of the exact sum,
  relative to sum |a_i b_i| (Higham, Accuracy and Stability, 3.1), whatever the order of the sum;
- rounding that float32 result to bf16 adds at most half a bf16 ulp, 2^-8 of its magnitude.
"""
from __future__ import annotations

import numpy as np
import pytest

from pympar import kernels
from pympar.backend import bfloat16
from pympar.kernels import gemm
from pympar.kernels import reference as R

needs_native = pytest.mark.skipif(not kernels.native_available(), reason="pympar._C is not built")
if kernels.native_available():
    from pympar.kernels import native as NK

U32, U16 = 2.0 ** -24, 2.0 ** -8      # unit roundoffs: float32 (24 bits), bf16 (8 bits): half an ulp, relative


def bf(a):
    return np.asarray(a, np.float32).astype(bfloat16)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def rounded(x32):
    """float32 -> bf16 (to nearest even), what every bf16 kernel does once per output."""
    return np.asarray(x32, np.float32).astype(bfloat16)


@pytest.fixture
def engines():
    """The bf16 engines this machine can run (always the float32 fallback), restoring the choice."""
    before = gemm._bf16_choice
    avail = ["float32"] + [e for e in ("amx", "avx512bf16", "mkl") if gemm._engine(e) is not None]
    yield avail
    gemm.use_bf16(before)


# --- the elementwise kernels: the float32 kernel's numbers on the widened inputs, rounded once ---
@needs_native
@pytest.mark.parametrize("threads_n", [1, 2])
def test_bf16_kernels_round_the_float32_kernels_once(threads, threads_n):
    threads(threads_n)
    rng = np.random.default_rng(0)
    Nr, C = 67, 96
    x, res, dy = (bf(rng.standard_normal((Nr, C)) * s) for s in (1.0, 0.5, 0.3))
    w, b = (rng.standard_normal(C).astype(np.float32) * 0.5 + 1, rng.standard_normal(C).astype(np.float32) * 0.1)
    f = lambda a: a.astype(np.float32)                       # noqa: E731  (exact)

    y, mean, rstd = NK.layernorm_forward(x, w, b)
    y32, mean32, rstd32 = NK.layernorm_forward(f(x), w, b)
    assert y.dtype == bfloat16 and mean.dtype == rstd.dtype == np.float32
    assert same_bits(y, rounded(y32)) and np.array_equal(mean, mean32) and np.array_equal(rstd, rstd32)

    xs = x.copy()
    y2, m2, r2 = NK.add_layernorm_forward(xs, res, w, b)
    s = rounded(f(x) + f(res))                               # the residual sum, rounded, kept in x
    assert same_bits(xs, s)
    y32, m32, r32 = NK.layernorm_forward(f(s), w, b)
    assert same_bits(y2, rounded(y32)) and np.array_equal(m2, m32)

    for residual in (None, res):
        dx, dw, db = NK.layernorm_backward(dy, x, w, mean, rstd, residual)
        dx32, dw32, db32 = NK.layernorm_backward(f(dy), f(x), w, mean, rstd, None)
        want = rounded(dx32) if residual is None else rounded(f(rounded(dx32)) + f(residual))
        assert same_bits(dx, want) and np.array_equal(dw, dw32) and np.array_equal(db, db32)

    h = bf(rng.standard_normal((Nr, C)) * 2)
    assert same_bits(NK.gelu_forward(h), rounded(NK.gelu_forward(f(h))))
    assert same_bits(NK.gelu_backward(h, dy), rounded(NK.gelu_backward(f(h), f(dy))))
    hb = h.copy()
    g = NK.bias_gelu_forward(hb, b)
    assert same_bits(hb, rounded(f(h) + b)) and same_bits(g, NK.gelu_forward(hb))
    yb = h.copy()
    assert NK.bias_add(yb, b) is yb and same_bits(yb, rounded(f(h) + b))
    cs = NK.column_sum(dy, np.float32)
    assert cs.dtype == np.float32 and np.array_equal(cs, f(dy).sum(axis=0))   # row after row, as NumPy


@needs_native
def test_bf16_kernels_agree_with_the_reference():
    """The reference (kernels/reference.py) rounds at the same points; the float32 math inside differs
    (exp_approx, the order of a row's sums) by a few float32 ulps, which can move a rounding to bf16 by
    one ulp: every element within one bf16 ulp (2 * 2^-8 of its magnitude) plus float32 noise."""
    rng = np.random.default_rng(1)
    x, res = bf(rng.standard_normal((33, 64))), bf(rng.standard_normal((33, 64)) * 0.5)
    w, b = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)

    def close(a, r):
        a, r = a.astype(np.float64), r.astype(np.float64)
        assert np.all(np.abs(a - r) <= 2 * U16 * np.abs(r) + 1e-6), float(np.max(np.abs(a - r)))
    y, mean, rstd = NK.layernorm_forward(x, w, b)
    yr, meanr, rstdr = R.layernorm_forward(x, w, b)
    close(y, yr)
    dx, dw, db = NK.layernorm_backward(res, x, w, mean, rstd, x)
    dxr, dwr, dbr = R.layernorm_backward(res, x, w, meanr, rstdr, x)
    close(dx, dxr)
    np.testing.assert_allclose(dw, dwr, rtol=1e-5, atol=1e-5)
    close(NK.gelu_forward(x), R.gelu_forward(x))
    hb, hr = x.copy(), x.copy()
    close(NK.bias_gelu_forward(hb, b), R.bias_gelu_forward(hr, b))
    assert same_bits(hb, hr)                                   # the rounded sum: one rounding of an exact sum


# --- the products ----------------------------------------------------------------------------
def _operands(rng, M, K, N):
    a = bf(rng.standard_normal((M, K)))
    w = bf(rng.standard_normal((N, K)))
    return [("x w^T", a, w.T), ("x W", a, np.ascontiguousarray(w.T)),
            ("a^T", np.ascontiguousarray(a.T).T, w.T),                         # dY^T of a weight gradient
            ("strided", bf(rng.standard_normal((M, K + 5)))[:, 2:2 + K], w.T)]


def _within_gamma(c, a, b):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact, mag = a64 @ b64, np.abs(a64) @ np.abs(b64)
    K = a.shape[1]
    gamma = K * U32 / (1 - K * U32)
    return np.all(np.abs(c.astype(np.float64) - exact) <= gamma * mag), exact, mag, gamma


@pytest.mark.parametrize("threads_n", [1, 2])
def test_bf16_products_on_every_engine(engines, threads, threads_n):
    threads(threads_n)
    rng = np.random.default_rng(2)
    from pympar.nn.products import matmul
    for engine in engines:
        gemm.use_bf16(engine)
        for (M, K, N) in [(64, 64, 64), (33, 45, 70), (200, 300, 130), (17, 1, 3), (1, 40, 1)]:
            for name, a, b in _operands(rng, M, K, N):
                c = np.full((M, N), np.nan, np.float32)
                y = matmul(a, b, np.float32, out=c)
                assert y is c
                ok, exact, mag, gamma = _within_gamma(c, a, b)
                assert ok, (engine, name, M, K, N)
                acc = c.copy()
                matmul(a, b, out=acc, accumulate=True)          # a gradient's second contribution
                assert np.all(np.abs(acc - 2 * exact) <= 2 * gamma * mag + 4 * U32 * np.abs(exact)), (engine, name)
                h = matmul(a, b)                                # bf16 out: the float32 sum rounded once more
                assert h.dtype == bfloat16
                assert np.all(np.abs(h.astype(np.float64) - exact) <= gamma * mag + U16 * np.abs(exact) * 1.01), \
                    (engine, name, M, K, N)


@pytest.mark.parametrize("engine", gemm.OWN_BF16)
@pytest.mark.parametrize("K", [96, 520])
def test_own_kernels_fused_epilogue_is_the_separate_kernels(engines, threads, engine, K):
    """pympar's kernels (AMX tiles, AVX512-BF16 dot products): round(A B + bias) and round(GELU(that))
    in the GEMM's epilogue equal the float32 product plus the bias rounded, and the GELU kernel on it,
    bit for bit; the pack of a weight, 1 or 2 threads and the A^T path give the same bits (each
    element's sum is the same tile's or lane's dot products, in k order). K = 520 runs several k-blocks
    (accumulators parked between them) and a partial last one."""
    if engine not in engines:
        pytest.skip(f"the {engine} engine cannot run on this CPU")
    gemm.use_bf16(engine)
    rng = np.random.default_rng(3)
    M, N = 130, 100
    x, w = bf(rng.standard_normal((M, K))), bf(rng.standard_normal((N, K)))
    bias = rng.standard_normal(N).astype(np.float32)
    c = gemm.product_bf16(x, w.T, np.empty((M, N), np.float32))
    h, g = np.empty((M, N), bfloat16), np.empty((M, N), bfloat16)
    assert gemm.product_bf16(x, w.T, h, bias=bias, gelu_out=g) is h
    assert same_bits(h, rounded(c + bias)) and same_bits(g, NK.gelu_forward(h))
    from pympar.nn.products import compute_copies
    with compute_copies():
        gemm.packable(w)
        assert gemm._packs.get(w.T, engine) is not None
        for n in (1, 2):
            threads(n)
            assert np.array_equal(gemm.product_bf16(x, w.T, np.empty((M, N), np.float32)), c)
    xt = np.ascontiguousarray(x.T).T
    assert np.array_equal(gemm.product_bf16(xt, w.T, np.empty((M, N), np.float32)), c)


def test_the_engine_follows_the_cpu(engines, monkeypatch):
    """AMX where the CPU has it and the AVX-512 kernels run, else pympar's AVX512-BF16 kernel where the
    CPU has those dot products (MKL's bf16 GEMM only by name: docs/precision.md has why); the AVX2 or
    generic kernels (a CPU without AVX-512, or PYMPAR_ISA) mean no native bf16 products: the
    fallback, and --dtype auto then chooses float32."""
    from pympar.config import ConfigError, apply_environment
    feats = gemm.cpu_features()
    if feats.get("amx_bf16") and gemm._C.amx_available():
        assert gemm._engine("auto") == "amx"
    elif feats.get("avx512bf16") and gemm._avx512_kernels() and gemm._C.dp_bf16_available():
        assert gemm._engine("auto") == "avx512bf16"
        with pytest.raises(ValueError, match="cannot run here"):
            gemm.use_bf16("amx")
    else:
        assert gemm._engine("auto") is None
        with pytest.raises(ValueError, match="cannot run here"):
            gemm.use_bf16("avx512bf16")
    try:
        kernels.use_isa("avx2") if feats.get("avx2") else kernels.use_isa("generic")
        assert gemm._engine("auto") is None and not gemm.bf16_native()
        assert "emulated" in gemm.describe_bf16()
        for name in gemm.OWN_BF16:
            with pytest.raises(ValueError, match="cannot run here"):
                gemm.use_bf16(name)
    finally:
        kernels.use_isa("")
    monkeypatch.setenv("PYMPAR_BF16_GEMM", "tiles")
    with pytest.raises(ConfigError, match="PYMPAR_BF16_GEMM"):
        apply_environment()


# --- the model: as close to float64 as PyTorch's autocast, and the engines agree ----------------
def _grads(model):
    return np.concatenate([p.grad.astype(np.float64).ravel() for _, p in sorted(model.named_parameters())])


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@needs_native
def test_bf16_model_is_as_accurate_as_torch_autocast(engines):
    """Loss and every gradient of pympar's bf16 model and of PyTorch's CPU autocast on the same
    weights, each against the float64 model: both carry bf16 roundings (activations, products'
    operands), at different points, so neither equals the other; pympar's error stays within 1.5x
    autocast's on every engine, and each is well below the
    O(1) relative error of a wrong gradient. Measured here on three batches: autocast's gradients
    4.1-4.5e-3 from float64, pympar's 1.20-1.22x that on every engine (its residual stream is bf16,
    autocast's float32: half the activation memory for that). The loss is a mean over B T = 128
    token losses whose bf16 errors (u = 2^-8 each) mostly cancel: within 2^-8 / sqrt(128) of it, or
    twice autocast's own error."""
    torch = pytest.importorskip("torch")
    from torch_ref import TorchGPT, load_numpy_state, numpy_grads, use_sdpa

    from pympar.nn import GPT, GPTConfig
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=96, block_size=32)
    rng = np.random.default_rng(4)
    idx, tg = rng.integers(0, 96, (4, 32)), rng.integers(0, 96, (4, 32))
    m64 = GPT(cfg, seed=1, dtype=np.float64)
    l64 = m64.loss_and_grad(idx, tg)
    g64 = _grads(m64)
    tm = use_sdpa(TorchGPT(cfg).float())
    load_numpy_state(tm, GPT(cfg, seed=1).state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, tl = tm(torch.tensor(idx), torch.tensor(tg))
    tl.backward()
    tgr = numpy_grads(tm)
    g_torch = np.concatenate([tgr[n].astype(np.float64).ravel() for n, _ in sorted(m64.named_parameters())])
    e_torch, el_torch = _rel(g_torch, g64), abs(tl.item() - l64)
    assert 1e-4 < e_torch < 0.1                                 # autocast does round (a check of the check)
    for engine in engines:
        gemm.use_bf16(engine)
        m = GPT(cfg, seed=1, compute_dtype="bfloat16")
        loss = m.loss_and_grad(idx, tg)
        e = _rel(_grads(m), g64)
        assert e < 1.5 * e_torch, (engine, e, e_torch)
        assert abs(loss - l64) < max(2 * el_torch, U16 / np.sqrt(idx.size) * abs(l64)), (engine, loss, l64)


@pytest.mark.parametrize("rows", [None, 7], ids=["mlp-one-block", "mlp-blocks-of-7"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bf16_recomputation_is_bitwise_the_same(engines, rows, moe, monkeypatch):
    """'selective' and 'full' give the gradients of 'none' bit for bit in bf16 too, on every engine:
    what backward computes again (a hidden layer, its GELU, a whole block) goes through the same
    products and epilogues as forward did."""
    from pympar.nn import GPT, GPTConfig, layers
    from pympar.nn.gpt import set_recompute
    if rows:
        monkeypatch.setattr(layers, "MLP_ROWS", rows)
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=40, block_size=16,
                    **(dict(n_expert=4, top_k=2, moe_every=2) if moe else {}))
    rng = np.random.default_rng(6)
    batches = [rng.integers(0, 40, (2, 17)) for _ in range(2)]
    for engine in engines:
        gemm.use_bf16(engine)
        got = {}
        for mode in ("none", "selective", "full"):
            m = set_recompute(GPT(cfg, seed=3, compute_dtype="bfloat16"), mode)
            loss = sum(m.loss_and_grad(x[:, :-1], x[:, 1:], grad_scale=0.5) for x in batches)
            got[mode] = (loss, {n: p.grad.copy() for n, p in m.named_parameters()})
        for mode in ("selective", "full"):
            assert got[mode][0] == got["none"][0], (engine, mode)
            for n, g in got["none"][1].items():
                assert np.array_equal(got[mode][1][n], g), (engine, mode, n)


# --- attention --------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("shape", [(1, 32, 1, 32), (2, 45, 2, 64), (1, 100, 3, 32), (2, 130, 2, 64)])
def test_bf16_attention_against_the_float32_kernel(engines, threads, shape):
    """bf16 attention (pympar's kernel where the engine is amx or avx512bf16: tiles or dot products; else
    widened to the float32 kernel) against the float32 kernel on the widened inputs. pympar's kernel
    rounds P and dS to bf16 before their products
    (bf16 flash attention's rounding points), each a relative 2^-8 per term: o within 2^-7 of max|o|,
    and the gradients, sums over T of such terms, within 2^-6 of their largest (measured: o 1.2-2.7e-3,
    dq/dk/dv 1.9-4.8e-3); lse within 2^-7 (l sums the rounded P). The widened path rounds only o and
    dqkv: within half a bf16 ulp of the float32 kernel's. 1 and 2 threads give the same bits."""
    B, T, H, D = shape
    rng = np.random.default_rng(7)
    qkv = bf(rng.standard_normal((B, T, 3, H, D)))
    dout = bf(rng.standard_normal((B, T, H * D)))
    sc = 1 / np.sqrt(D)
    f = lambda a: a.astype(np.float32)                       # noqa: E731
    o32, lse32 = NK.attention_forward(f(qkv), sc)
    g32 = NK.attention_backward(f(qkv), o32, lse32, f(dout), sc)
    for engine in engines:
        gemm.use_bf16(engine)
        own = engine in gemm.OWN_BF16 and D % 32 == 0
        got = []
        for n in (1, 2):
            threads(n)
            o, lse = NK.attention_forward(qkv, sc)
            g = NK.attention_backward(qkv, o, lse, dout, sc)
            got.append((o, lse, g))
        assert all(np.array_equal(x.view(np.uint16) if x.dtype == bfloat16 else x, y.view(np.uint16) if y.dtype == bfloat16 else y)
                   for x, y in zip(got[0][:2] + (got[0][2],), got[1][:2] + (got[1][2],))), engine
        o, lse, g = got[0]
        assert o.dtype == g.dtype == bfloat16 and lse.dtype == np.float32
        mine = qkv.copy()                                    # dqkv written over qkv (the model's consume)
        assert same_bits(NK.attention_backward(mine, o, lse, dout, sc, overwrite=True), g), engine
        if own:
            assert not np.array_equal(lse, lse32), engine    # pympar's kernel ran (its l sums the rounded P)
            assert np.max(np.abs(f(o) - o32)) <= 2 ** -7 * np.max(np.abs(o32)), engine
            assert np.max(np.abs(lse - lse32)) <= 2 ** -7, engine
            for i in range(3):
                assert np.max(np.abs(f(g[:, :, i]) - g32[:, :, i])) <= 2 ** -6 * np.max(np.abs(g32[:, :, i])), (engine, i)
        else:                                                # (backward reads the rounded o, as given)
            assert same_bits(o, rounded(o32)) and np.array_equal(lse, lse32)
            assert same_bits(g, rounded(NK.attention_backward(f(qkv), f(o), lse, f(dout), sc)))


# --- bf16 optimizer moments -------------------------------------------------------------------
@needs_native
def test_adamw_with_bf16_moments_is_the_reference():
    """AdamW with bf16 m and v beside float32 weights: each moment updated in float32 from its widened
    value, the step taken from those float32 moments, the moments stored rounded once -- the C++ kernel
    gives the reference's moments bit for bit and its weights to a float32 ulp (sqrt and division
    round alike; the order of the step's operations is the reference's)."""
    rng = np.random.default_rng(8)
    p = rng.standard_normal(1000).astype(np.float32)
    m, v = bf(rng.standard_normal(1000) * 1e-2), bf(np.abs(rng.standard_normal(1000)) * 1e-4)
    g = rng.standard_normal(1000).astype(np.float32) * 1e-2
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)
    p1, m1, v1 = p.copy(), m.copy(), v.copy()
    NK.adamw_step(p1, g, m1, v1, **kw)
    p2, m2, v2 = p.copy(), m.copy(), v.copy()
    R.adamw_step(p2, g, m2, v2, **kw)
    assert same_bits(m1, m2) and same_bits(v1, v2)
    np.testing.assert_allclose(p1, p2, rtol=2 * U32, atol=0)
    assert not np.array_equal(p1, p)                         # it moved


def test_bf16_moments_halve_the_optimizer_state_and_train_alike():
    """--moments-dtype bfloat16: AdamW's state takes half the bytes (measured by tracemalloc around its
    construction, not by what it reports), and 40 steps of a small model on a learnable sequence (each
    row counts up by a fixed stride) land where the float32 moments' run does: loss 4.59 -> 1.74-1.96,
    the two within 1.1e-4 of each other on three seeds; bound 1e-3 (a step reads m / sqrt(v), whose
    rounding is about 1.5 x 2^-8 relative, and AdamW's steps of ~lr barely feel it)."""
    import tracemalloc

    from pympar.nn import GPT, GPTConfig
    from pympar.optim import AdamW
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=96, block_size=32)
    rng = np.random.default_rng(11)
    batches = [(rng.integers(0, 96, (4, 1)) + np.arange(33) * rng.integers(1, 4, (4, 1))) % 96 for _ in range(40)]
    losses, held = {}, {}
    for mdt in ("float32", "bfloat16"):
        m = GPT(cfg, seed=2)
        named = list(m.named_parameters())
        for _, q in named:                                   # the weights are made on first use: now
            q.data
        tracemalloc.start()
        opt = AdamW(named, lr=3e-3, moments_dtype=mdt)
        held[mdt] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        for x in batches:
            m.zero_grad()
            loss = m.loss_and_grad(x[:, :-1], x[:, 1:])
            opt.step()
        losses[mdt] = loss
        assert all(a.dtype == (np.float32 if mdt == "float32" else bfloat16) for a in opt.m.values())
    n = sum(p.data.size for _, p in named)
    assert abs(held["float32"] - 8 * n) < 0.05 * 8 * n and abs(held["bfloat16"] - 4 * n) < 0.05 * 4 * n, (held, n)
    assert losses["float32"] < 2.5 and abs(losses["bfloat16"] - losses["float32"]) < 1e-3 * losses["float32"], losses


@needs_native
def test_bf16_unpermute_add_is_the_reference():
    """MoE's combine on bf16 expert outputs: out[rows[i]] += round(y[i] w[i]), each sum rounded, in the
    order of i -- np.add.at's numbers on bf16 arrays, bit for bit (repeated rows included)."""
    rng = np.random.default_rng(12)
    y = bf(rng.standard_normal((40, 24)))
    rows = rng.integers(0, 10, 40)
    w = rng.random(40).astype(np.float32)
    for weights in (w, None):
        assert same_bits(NK.unpermute_add(y, rows, weights, 10), R.unpermute_add(y, rows, weights, 10))


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_bf16_activations_are_what_the_ledger_predicts_and_half_of_float32(mode):
    """What a bf16 model's forward keeps for backward (each buffer once: held_bytes of the ctxs) is the
    planner's activation bytes at act_bytes = 2 (lse, statistics and the head's logits float32) to 0.1%,
    as the float32 model's is at 4; without recomputation that is 0.5-0.6 of float32's (half, but for
    the float32 statistics, logits and token ids; 'full' keeps little besides the head's logits)."""
    from pympar.nn import GPT, GPTConfig
    from pympar.nn.gpt import set_recompute
    from pympar.parallel import ledger
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=96, block_size=64)
    x = np.random.default_rng(13).integers(0, 96, (2, 65))
    kept = {}
    for cdt in (None, "bfloat16"):
        m = set_recompute(GPT(cfg, seed=1, compute_dtype=cdt), mode)
        stats = {}
        m.loss_and_grad(x[:, :-1], x[:, 1:], stats=stats)
        kept[cdt] = stats["activation_bytes"]
    for cdt, a in ((None, 4), ("bfloat16", 2)):
        want = ledger.activations_per_micro(cfg, 2, 64, 1, False, mode, range(2), True, True, a, 4, tiled=True)
        assert abs(kept[cdt] - want) <= 1e-3 * want, (cdt, kept, want)
    if mode == "none":
        assert 0.5 <= kept["bfloat16"] / kept[None] < 0.6, kept
