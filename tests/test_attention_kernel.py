"""The tiled (flash-attention style) causal attention kernel against its definitions.

- the C++ kernel against its pure-NumPy twin (kernels.reference.attention_forward/backward):
  float64 to 1e-12, float32 to 1e-5, for odd T, T not a multiple of the 64-row tile, one head,
  many heads, batch 1 and 7;
- the attention core's tiled path against its materialized path (the reference the model used
  before), forward and backward, inside the full model too (loss and every gradient);
- 1, 2 and 3 threads give bit-identical results (the determinism rule), the backward's
  per-head split and its key-tile/query-tile split alike;
- memory linear in T: a process running forward+backward at T=4096 grows its peak resident
  memory by far less than one (T, T) float32 matrix (64 MiB);
- the block kernel (ring attention's: q against k, v of another block, causal or not, read as
  strided views of packed arrays) against its twin, and the ring identity: the zigzag blocks of
  context parallelism, merged by their lse, give the full causal attention's o, lse and, with the
  merged o, lse, summed gradients equal to the full backward's; 1, 2, 3 threads bit-identical.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pympar.kernels as K
from pympar.kernels import reference as R
from pympar.nn import GPT, GPTConfig
from pympar.nn.attention_core import CausalAttentionCore

pytestmark = pytest.mark.skipif(not K.native_available(), reason="pympar._C is not built")
if K.native_available():
    from pympar.kernels import native as N

TOL = {np.float64: 1e-12, np.float32: 1e-5}
SHAPES = [(1, 1, 1, 4), (2, 7, 3, 5), (1, 63, 1, 16), (1, 65, 2, 16), (7, 130, 2, 32), (1, 200, 4, 64),
          (7, 33, 1, 8), (1, 129, 12, 64), (2, 75, 2, 12)]   # D 12: an 8-wide block and 4 more columns


def _rel(a, b):
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))


@pytest.fixture
def threads():
    yield
    K.set_num_threads(1)


@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B%dT%dH%dD%d" % s)
def test_kernel_equals_its_reference(dt, shape):
    B, T, H, D = shape
    rng = np.random.default_rng(T * 31 + H)
    qkv = (rng.standard_normal((B, T, 3, H, D)) * 2).astype(dt)
    dout = rng.standard_normal((B, T, H * D)).astype(dt)
    sc = 1 / np.sqrt(D)
    o, lse = N.attention_forward(qkv, sc)
    o_ref, lse_ref = R.attention_forward(qkv, sc)
    assert o.dtype == lse.dtype == np.dtype(dt) and o.shape == (B, T, H * D) and lse.shape == (B, H, T)
    assert _rel(o, o_ref) < TOL[dt] and _rel(lse, lse_ref) < TOL[dt]
    g = N.attention_backward(qkv, o, lse, dout, sc)
    g_ref = R.attention_backward(qkv, o_ref, lse_ref, dout, sc)
    assert g.shape == qkv.shape
    assert _rel(g, g_ref) < TOL[dt], _rel(g, g_ref)


def test_reference_is_the_softmax_definition():
    """The twin itself against a direct loop over rows (no shared code)."""
    rng = np.random.default_rng(3)
    B, T, H, D = 2, 9, 2, 3
    qkv = rng.standard_normal((B, T, 3, H, D))
    o, lse = R.attention_forward(qkv, 0.5)
    for b in range(B):
        for h in range(H):
            q, k, v = (qkv[b, :, i, h] for i in range(3))
            for t in range(T):
                s = (q[t] * 0.5) @ k[:t + 1].T
                p = np.exp(s - s.max())
                np.testing.assert_allclose(o[b, t, h * D:(h + 1) * D], p @ v[:t + 1] / p.sum(), rtol=1e-13)
                np.testing.assert_allclose(lse[b, h, t], s.max() + np.log(p.sum()), rtol=1e-13)


@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(1, 100, 3, 16), (7, 65, 1, 8)], ids=str)
def test_core_tiled_equals_materialized(dt, shape, monkeypatch):
    B, T, H, D = shape
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((B, T, 3, H, D)).astype(dt)
    dya = rng.standard_normal((B, T, H * D)).astype(dt)
    out = {}
    for impl in ("tiled", "materialized"):
        core = CausalAttentionCore()
        core.impl = impl
        ya, ctx = core.forward(qkv)
        assert isinstance(ctx[0], str) == (impl == "tiled")
        out[impl] = ya, core.backward(dya, ctx)
    for a, b in zip(out["tiled"], out["materialized"]):
        assert _rel(a, b) < TOL[dt]


def test_model_tiled_equals_materialized(monkeypatch):
    cfg = GPTConfig(vocab_size=97, block_size=70, n_layer=2, n_head=2, n_embd=32)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, size=(3, cfg.block_size + 1))
    res = {}
    for impl in ("tiled", "materialized"):
        monkeypatch.setattr(CausalAttentionCore, "impl", impl)
        model = GPT(cfg, seed=5, dtype=np.float64)
        loss = model.loss_and_grad(x[:, :-1], x[:, 1:])
        res[impl] = loss, {n: p.grad.copy() for n, p in model.named_parameters()}
    assert abs(res["tiled"][0] - res["materialized"][0]) < 1e-12
    for n, g in res["materialized"][1].items():
        assert _rel(res["tiled"][1][n], g) < 1e-11, n


def test_impl_tiled_where_unavailable_is_a_clear_error():
    core = CausalAttentionCore()
    core.impl = "tiled"
    with pytest.raises(ValueError, match="float32/float64"):
        core.forward(np.zeros((1, 4, 3, 1, 2), dtype=np.float16))
    core.impl = "fast"
    with pytest.raises(ValueError, match="expected one of"):
        core.forward(np.zeros((1, 4, 3, 1, 2)))


@pytest.mark.parametrize("shape", [(3, 150, 2, 24), (1, 200, 1, 16), (1, 150, 2, 24)], ids=str)
def test_thread_counts_bit_identical(threads, shape):
    """1, 2 and 3 threads: the same bits. With fewer heads than threads the backward splits over
    key tiles and query tiles instead of heads (B*H = 1 and 2 here); the sums keep their order."""
    B, T, H, D = shape
    rng = np.random.default_rng(2)
    qkv = rng.standard_normal((B, T, 3, H, D)).astype(np.float32)
    dout = rng.standard_normal((B, T, H * D)).astype(np.float32)
    res = []
    for n in (1, 2, 3):
        K.set_num_threads(n)
        o, lse = N.attention_forward(qkv, 0.2)
        res.append((o, lse, N.attention_backward(qkv, o, lse, dout, 0.2)))
    for other in res[1:]:
        for a, b in zip(res[0], other):
            np.testing.assert_array_equal(a, b)
    ref = R.attention_backward(qkv, *R.attention_forward(qkv, 0.2), dout, 0.2)
    assert _rel(res[2][2], ref) < 1e-5


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", [(3, 150, 2, 24), (1, 200, 1, 16), (2, 65, 3, 8)], ids=str)
@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=["f32", "f64"])
def test_backward_over_qkv_is_bitwise_the_fresh_one(threads, shape, dt):
    """overwrite=True (what a consuming attention backward asks): dqkv is written over qkv -- the
    same memory comes back -- and equals, bit for bit, the gradient written into a fresh array,
    whichever way the work is split (B*H >= threads: a thread per head; B*H = 1 or 2 below 3
    threads: key tiles, then query tiles, every head read before any is written)."""
    B, T, H, D = shape
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((B, T, 3, H, D)).astype(dt)
    dout = rng.standard_normal((B, T, H * D)).astype(dt)
    K.set_num_threads(threads)
    try:
        o, lse = N.attention_forward(qkv, 0.3)
        fresh = N.attention_backward(qkv, o, lse, dout, 0.3)
        mine = qkv.copy()
        over = N.attention_backward(mine, o, lse, dout, 0.3, overwrite=True)
    finally:
        K.set_num_threads(1)
    assert over is mine
    np.testing.assert_array_equal(over, fresh)
    np.testing.assert_array_equal(N.attention_backward(qkv, o, lse, dout, 0.3), fresh)   # qkv untouched
    qkv.flags.writeable = False                  # a read-only qkv is not written over: a fresh dqkv
    ro = N.attention_backward(qkv, o, lse, dout, 0.3, overwrite=True)
    assert ro is not qkv
    np.testing.assert_array_equal(ro, fresh)


def test_self_attention_backward_makes_no_second_qkv():
    """CausalSelfAttention's backward consumes its ctx: dqkv goes over qkv, so what NumPy allocates
    (traced; the kernel's C++ scratch is not) is c_proj's and c_attn's dx (1C each per token),
    not a further 3C for a fresh dqkv."""
    import tracemalloc

    from pympar.nn.attention import CausalSelfAttention
    B, T, C, H = 1, 2048, 64, 2
    attn = CausalSelfAttention(C, H, name="a", seed=1)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    dy = rng.standard_normal((B, T, C)).astype(np.float32)
    y, ctx = attn.forward(x)
    for p in attn.parameters():
        p.grad                                   # allocated before: not the backward's transient
    one = B * T * C * 4
    tracemalloc.start()
    try:
        dx = attn.backward(dy, ctx)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del ctx
    assert dx.shape == x.shape
    assert peak <= 2 * one + 2**16, peak / one


PEAK = textwrap.dedent("""
    import numpy as np, sys
    from pympar.kernels import native as N
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    T, H, D = int(sys.argv[1]), 2, 32
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((1, T, 3, H, D)).astype(np.float32)
    dout = rng.standard_normal((1, T, H * D)).astype(np.float32)
    o, lse = N.attention_forward(qkv[:, :64], 0.2); N.attention_backward(qkv[:, :64], o, lse, dout[:, :64], 0.2)
    before = hwm()
    o, lse = N.attention_forward(qkv, 0.2)
    dq = N.attention_backward(qkv, o, lse, dout, 0.2)
    print(hwm() - before)
""")


def test_memory_is_linear_in_T():
    """Forward + backward at T=4096 (2 heads of 32): the peak grows by the outputs and the
    per-thread O(T * D) scratch, a few MiB, never by a (T, T) matrix (64 MiB in float32)."""
    r = subprocess.run([sys.executable, "-c", PEAK, "4096"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    grew = int(r.stdout.split()[-1])
    linear = 4096 * 2 * 32 * 4 * (3 + 1 + 7)                  # dqkv, o, one thread's scratch: 11 MiB
    assert grew < linear + (4 << 20), grew
    assert grew < 4096 * 4096 * 4 // 4, grew


# --- one block of ring attention: q (B, Tq, H, D) against k, v (B, Tk, H, D) -------------------
BLOCKS = [(1, 1, 1, 1, 4, True), (3, 65, 65, 4, 16, True), (1, 129, 129, 4, 64, True), (3, 7, 7, 1, 5, True),
          (1, 130, 65, 1, 8, False), (3, 65, 130, 4, 8, False), (1, 74, 37, 4, 16, False),
          (3, 37, 74, 1, 32, False), (1, 7, 200, 4, 5, False), (3, 200, 7, 1, 24, False), (1, 1, 1, 1, 4, False)]


def _block_views(rng, B, Tq, Tk, H, D, causal, dt):
    """q, k, v as ring attention holds them: causal, the views [:, :, 0/1/2] of packed qkv; otherwise
    q the second part of packed qkv (qkv[:, c:, 0]) and k, v the front of a (B, T, 2, H, D) buffer."""
    if causal:
        qkv = (rng.standard_normal((B, Tq, 3, H, D)) * 2).astype(dt)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    qkv = (rng.standard_normal((B, Tq + 3, 3, H, D)) * 2).astype(dt)
    kv = (rng.standard_normal((B, Tk + 5, 2, H, D)) * 2).astype(dt)
    return qkv[:, 3:, 0], kv[:, :Tk, 0], kv[:, :Tk, 1]


@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("case", BLOCKS, ids=lambda c: "B{}Tq{}Tk{}H{}D{}{}".format(*c[:5], "c" if c[5] else "n"))
def test_block_kernel_equals_its_reference(dt, case):
    B, Tq, Tk, H, D, causal = case
    rng = np.random.default_rng(Tq * 7 + Tk)
    q, k, v = _block_views(rng, B, Tq, Tk, H, D, causal, dt)
    assert all(N._in_place(a) is a for a in (q, k, v))           # read in place, no copy
    dout = rng.standard_normal((B, Tq, H * D)).astype(dt)
    sc = 1 / np.sqrt(D)
    o, lse = K.attention_block_forward(q, k, v, sc, causal)
    o_ref, lse_ref = R.attention_block_forward(q, k, v, sc, causal)
    assert o.dtype == lse.dtype == np.dtype(dt) and o.shape == (B, Tq, H * D) and lse.shape == (B, H, Tq)
    assert o.flags.c_contiguous and o_ref.flags.c_contiguous
    assert _rel(o, o_ref) < TOL[dt] and _rel(lse, lse_ref) < TOL[dt]
    g = K.attention_block_backward(q, k, v, o, lse, dout, sc, causal)
    g_ref = R.attention_block_backward(q, k, v, o_ref, lse_ref, dout, sc, causal)
    for a, b, shape in zip(g, g_ref, [(B, Tq, H, D), (B, Tk, H, D), (B, Tk, H, D)]):
        assert a.shape == b.shape == shape and a.dtype == np.dtype(dt) and a.flags.c_contiguous
        assert _rel(a, b) < TOL[dt], _rel(a, b)
    # any other layout (here a last axis with stride 2) is copied first: the same numbers
    gapped = [np.zeros(a.shape[:-1] + (2 * D,), dtype=dt)[..., ::2] for a in (q, k, v)]
    for a, b in zip(gapped, (q, k, v)):
        a[...] = b
        assert N._in_place(a) is not a
    np.testing.assert_array_equal(K.attention_block_forward(*gapped, sc, causal)[0], o)


def test_packed_kernel_is_the_causal_block_of_its_views():
    rng = np.random.default_rng(4)
    qkv = rng.standard_normal((2, 100, 3, 3, 16))
    dout = rng.standard_normal((2, 100, 48))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    o, lse = N.attention_forward(qkv, 0.25)
    ob, lseb = N.attention_block_forward(q, k, v, 0.25, True)
    np.testing.assert_array_equal(o, ob)
    np.testing.assert_array_equal(lse, lseb)
    np.testing.assert_array_equal(N.attention_backward(qkv, o, lse, dout, 0.25),
                                  np.stack(N.attention_block_backward(q, k, v, o, lse, dout, 0.25, True), axis=2))


@pytest.mark.parametrize("impl", ["native", "reference", "bfloat16"])
def test_block_backward_writes_into_strided_out(impl, monkeypatch):
    """out=(dq, dk, dv): the gradients land in the given views (the ring's packed dqkv, a head
    slice of it) with the bits of the call that allocates them, and nothing else is touched; o and
    dout given as a head group's columns of some query rows (read through their strides: a batch
    stride that is not the rows' count times the row stride) give the bits of copies. The native
    kernel writes such views itself: its fallback (compute, then copy in) runs only for an out it
    cannot write, here a Fortran-ordered one. An out of the wrong shapes or dtype, or overlapping
    itself or an input, is refused."""
    mod = R if impl == "reference" else N
    rng = np.random.default_rng(8)
    B, Tq, Tk, H, D = 2, 40, 70, 3, 8
    dt = np.float32
    q, k, v = (rng.standard_normal((B, n, H, D)).astype(dt) for n in (Tq, Tk, Tk))
    dout = rng.standard_normal((B, Tq, H * D)).astype(dt)
    if impl == "bfloat16":                             # computed in float32, then written into out
        from pympar.backend import bfloat16
        q, k, v, dout = (a.astype(bfloat16) for a in (q, k, v, dout))
    o, lse = mod.attention_block_forward(q, k, v, 0.3, False)
    want = mod.attention_block_backward(q, k, v, o, lse, dout, 0.3, False)
    hd, cols, rows = slice(1, 3), slice(D, 3 * D), slice(3, Tq)   # two heads (a ring head group), some rows
    sub = (q[:, rows, hd], k[:, :, hd], v[:, :, hd], o[:, rows, cols], lse[:, hd, rows], dout[:, rows, cols])
    want_sub = mod.attention_block_backward(*(np.ascontiguousarray(a) for a in sub), 0.3, False)
    fallbacks = []
    if impl == "native":
        inner = N.attention_block_backward
        monkeypatch.setattr(N, "attention_block_backward", lambda *a, **kw: fallbacks.append(1) or inner(*a, **kw))
    dqs = np.full((B, Tq, H, D), 7, dtype=q.dtype)
    dkv = np.full((B, Tk, 2, H, D), 7, dtype=q.dtype)  # packed (B, Tk, 2, H, D), as the ring's partial
    got = (inner if impl == "native" else mod.attention_block_backward)(
        *sub, 0.3, False, out=(dqs[:, rows, hd], dkv[:, :, 0, hd], dkv[:, :, 1, hd]))
    assert got[0].base is dqs and got[1].base is dkv and not fallbacks
    for a, b in zip(got, want_sub):
        np.testing.assert_array_equal(a, b)
    assert (dqs[:, :, 0] == 7).all() and (dqs[:, :3] == 7).all() and (dkv[:, :, :, 0] == 7).all()  # untouched
    full = mod.attention_block_backward(q, k, v, o, lse, dout, 0.3, False, out=(dqs, dkv[:, :, 0], dkv[:, :, 1]))
    for a, b in zip(full, want):
        np.testing.assert_array_equal(a, b)
    if impl == "native":                               # an out the kernel cannot write: computed, then copied
        fortran = [np.asfortranarray(np.zeros_like(a)) for a in want]
        for a, b in zip(inner(q, k, v, o, lse, dout, 0.3, False, out=fortran), want):
            np.testing.assert_array_equal(a, b)
        assert fallbacks
    with pytest.raises(ValueError, match="out has shapes"):
        mod.attention_block_backward(q, k, v, o, lse, dout, 0.3, False, out=(dqs, dkv[:, :, 0]))
    with pytest.raises(ValueError, match="out has dtypes"):
        mod.attention_block_backward(q, k, v, o, lse, dout, 0.3, False,
                                     out=tuple(np.zeros(a.shape, np.float64) for a in want))
    with pytest.raises(ValueError, match="out's dk shares memory with dv"):   # one view twice
        mod.attention_block_backward(q, k, v, o, lse, dout, 0.3, False, out=(dqs, dkv[:, :, 0], dkv[:, :, 0]))
    with pytest.raises(ValueError, match="out's dq shares memory with q"):    # over an input still read
        mod.attention_block_backward(q, k, v, o, lse, dout, 0.3, False, out=(q, dkv[:, :, 0], dkv[:, :, 1]))
    with pytest.raises(ValueError, match="out's dq shares memory with dout"):
        mod.attention_block_backward(q, k, v, o, lse, dout, 0.3, False,
                                     out=(dout.reshape(q.shape), dkv[:, :, 0], dkv[:, :, 1]))


@pytest.mark.parametrize("mod", [N, R], ids=["native", "reference"])
def test_block_backward_without_queries_gives_zero_key_gradients(mod):
    """Tq = 0: no query sees the keys, so dk and dv are 0 (written, also into out)."""
    rng = np.random.default_rng(9)
    k, v = rng.standard_normal((2, 2, 5, 3, 4))
    q, o, lse, dout = np.zeros((2, 0, 3, 4)), np.zeros((2, 0, 12)), np.zeros((2, 3, 0)), np.zeros((2, 0, 12))
    out = (np.empty((2, 0, 3, 4)), np.full((2, 5, 3, 4), 7.0), np.full((2, 5, 3, 4), 7.0))
    for g in (mod.attention_block_backward(q, k, v, o, lse, dout, 0.5, False),
              mod.attention_block_backward(q, k, v, o, lse, dout, 0.5, False, out=out)):
        assert g[0].shape == (2, 0, 3, 4) and not g[1].any() and not g[2].any()


def test_block_reference_is_the_softmax_definition():
    """The non-causal twin against a direct loop over query rows (no shared code)."""
    rng = np.random.default_rng(5)
    B, Tq, Tk, H, D = 2, 5, 8, 2, 3
    q, k, v = rng.standard_normal((B, Tq, H, D)), rng.standard_normal((B, Tk, H, D)), rng.standard_normal((B, Tk, H, D))
    o, lse = R.attention_block_forward(q, k, v, 0.5, False)
    for b in range(B):
        for h in range(H):
            for t in range(Tq):
                s = (q[b, t, h] * 0.5) @ k[b, :, h].T
                p = np.exp(s - s.max())
                np.testing.assert_allclose(o[b, t, h * D:(h + 1) * D], p @ v[b, :, h] / p.sum(), rtol=1e-13)
                np.testing.assert_allclose(lse[b, h, t], s.max() + np.log(p.sum()), rtol=1e-13)


def _zigzag(cp, c):
    """The positions rank i of cp holds: chunks i and 2 cp - 1 - i of c positions each, in that order."""
    return [np.r_[i * c:(i + 1) * c, (2 * cp - 1 - i) * c:(2 * cp - i) * c] for i in range(cp)]


def _ring_blocks(cp, c):
    """(i, j, query rows, key rows): local query rows of rank i against local key rows of rank j, and
    whether the block is causal. j == i: the local causal block; j < i: every local query against the
    first chunk of rank j (all earlier); j > i: the second chunk's queries against all of rank j."""
    out = []
    for i in range(cp):
        for j in range(cp):
            if j == i:
                out.append((i, j, slice(0, 2 * c), slice(0, 2 * c), True))
            elif j < i:
                out.append((i, j, slice(0, 2 * c), slice(0, c), False))
            else:
                out.append((i, j, slice(c, 2 * c), slice(0, 2 * c), False))
    return out


@pytest.mark.parametrize("cp,c,B,H,D", [(2, 37, 3, 4, 16), (2, 70, 1, 1, 8), (3, 33, 1, 4, 8), (4, 17, 3, 1, 5)],
                         ids=str)
def test_ring_zigzag_blocks_make_the_full_causal_attention(cp, c, B, H, D):
    T = 2 * cp * c
    rng = np.random.default_rng(T + cp)
    qkv = rng.standard_normal((B, T, 3, H, D)) * 2
    dout = rng.standard_normal((B, T, H * D))
    sc = 1 / np.sqrt(D)
    o_full, lse_full = K.attention_forward(qkv, sc)
    g_full = K.attention_backward(qkv, o_full, lse_full, dout, sc)
    pos = _zigzag(cp, c)
    assert sorted(np.concatenate(pos).tolist()) == list(range(T))
    local = [qkv[:, p] for p in pos]                                # (B, 2c, 3, H, D) per rank
    blocks = _ring_blocks(cp, c)

    # every (query, key) pair the causal mask allows appears in exactly one block
    seen = np.zeros((T, T), dtype=int)
    for i, j, qr, kr, causal in blocks:
        qp, kp = pos[i][qr], pos[j][kr]
        allowed = np.ones((len(qp), len(kp)), dtype=bool)
        if causal:
            allowed = np.tril(allowed)
        assert (kp[None, :] <= qp[:, None])[allowed].all()
        seen[np.ix_(qp, kp)] += allowed
    np.testing.assert_array_equal(seen, np.tril(np.ones((T, T), dtype=int)))

    # forward: each rank's blocks merged by their lse
    merged = []
    for i in range(cp):
        o = np.zeros((B, 2 * c, H * D))
        lse = np.full((B, H, 2 * c), -np.inf)
        for i_, j, qr, kr, causal in blocks:
            if i_ != i:
                continue
            ob, lb = K.attention_block_forward(local[i][:, qr, 0], local[j][:, kr, 1], local[j][:, kr, 2], sc, causal)
            new = np.logaddexp(lse[:, :, qr], lb)
            w_old = np.exp(lse[:, :, qr] - new).transpose(0, 2, 1).repeat(D, axis=2)   # (B, Tq, H*D)
            w_new = np.exp(lb - new).transpose(0, 2, 1).repeat(D, axis=2)
            o[:, qr] = o[:, qr] * w_old + ob * w_new
            lse[:, :, qr] = new
        assert _rel(o, o_full[:, pos[i]]) < 1e-12
        assert _rel(lse, lse_full[:, :, pos[i]]) < 1e-12
        merged.append((o, lse))

    # backward: every block with its rank's merged o, lse; the sums are the full gradients
    dqkv = np.zeros_like(qkv)
    for i, j, qr, kr, causal in blocks:
        o, lse = merged[i]
        dq, dk, dv = K.attention_block_backward(local[i][:, qr, 0], local[j][:, kr, 1], local[j][:, kr, 2],
                                                o[:, qr], lse[:, :, qr], dout[:, pos[i][qr]], sc, causal)
        dqkv[:, pos[i][qr], 0] += dq
        dqkv[:, pos[j][kr], 1] += dk
        dqkv[:, pos[j][kr], 2] += dv
    for n in range(3):
        assert _rel(dqkv[:, :, n], g_full[:, :, n]) < 1e-12, ("dq", "dk", "dv")[n]


@pytest.mark.parametrize("shape", [(3, 150, 90, 2, 24, False), (1, 200, 130, 1, 16, False),
                                   (1, 90, 200, 2, 16, False), (1, 150, 150, 2, 24, True)], ids=str)
def test_block_thread_counts_bit_identical(threads, shape):
    """1, 2 and 3 threads: the same bits, with the backward split per head (B*H = 6) and over key
    tiles then query tiles (B*H = 1, 2)."""
    B, Tq, Tk, H, D, causal = shape
    rng = np.random.default_rng(6)
    q, k, v = _block_views(rng, B, Tq, Tk, H, D, causal, np.float32)
    dout = rng.standard_normal((B, Tq, H * D)).astype(np.float32)
    res = []
    for n in (1, 2, 3):
        K.set_num_threads(n)
        o, lse = N.attention_block_forward(q, k, v, 0.2, causal)
        res.append((o, lse) + N.attention_block_backward(q, k, v, o, lse, dout, 0.2, causal))
    for other in res[1:]:
        for a, b in zip(res[0], other):
            np.testing.assert_array_equal(a, b)
    ref = R.attention_block_backward(q, k, v, *R.attention_block_forward(q, k, v, 0.2, causal), dout, 0.2, causal)
    for a, b in zip(res[2][2:], ref):
        assert _rel(a, b) < 1e-5


def test_block_errors_name_the_wrong_value():
    q, k = np.zeros((1, 4, 2, 8)), np.zeros((1, 6, 2, 8))
    with pytest.raises(ValueError, match="causal needs Tq == Tk, got Tq=4 Tk=6"):
        K.attention_block_forward(q, k, k, 1.0, True)
    with pytest.raises(ValueError, match="must be"):
        K.attention_block_forward(q, k, np.zeros((1, 6, 2, 4)), 1.0, False)
    with pytest.raises(ValueError, match="Tk=0"):
        N.attention_block_forward(q, k[:, :0], k[:, :0], 1.0, False)
    o, lse = np.empty((1, 4, 16)), np.empty((1, 2, 4))
    from pympar import _C
    with pytest.raises(ValueError, match="last axis must be contiguous and the head stride D"):
        _C.attention_block_forward(q, np.zeros((1, 6, 2, 16))[..., ::2], k, o, lse, 1.0, False)
    with pytest.raises(ValueError, match="k has dtype float32, expected the dtype of q"):
        _C.attention_block_forward(q, k.astype(np.float32), k, o, lse, 1.0, False)
    with pytest.raises(ValueError, match=r"v has shape \(1, 5, 2, 8\), expected"):
        _C.attention_block_forward(q, k, k[:, :5], o, lse, 1.0, False)
    with pytest.raises(ValueError, match="causal needs Tq == Tk"):
        _C.attention_block_forward(q, k, k, o, lse, 1.0, True)
