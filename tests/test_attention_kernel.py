"""The tiled (flash-attention style) causal attention kernel against its definitions.

- the C++ kernel against its pure-NumPy twin (kernels.reference.attention_forward/backward):
  float64 to 1e-12, float32 to 1e-5, for odd T, T not a multiple of the 64-row tile, one head,
  many heads, batch 1 and 7;
- the attention core's tiled path against its materialized path (the reference the model used
  before), forward and backward, inside the full model too (loss and every gradient);
- 1, 2 and 3 threads give bit-identical results (the determinism rule), the backward's
  per-head split and its key-tile/query-tile split alike;
- memory linear in T: a process running forward+backward at T=4096 grows its peak resident
  memory by far less than one (T, T) float32 matrix (64 MiB).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import pympar
import pympar.kernels as K
from pympar.kernels import reference as R
from pympar.nn import GPT, GPTConfig
from pympar.nn.attention_core import CausalAttentionCore

pytestmark = pytest.mark.skipif(not K.native_available(), reason="pympar._C is not built")
if K.native_available():
    from pympar.kernels import native as N

TOL = {np.float64: 1e-12, np.float32: 1e-5}
SHAPES = [(1, 1, 1, 4), (2, 7, 3, 5), (1, 63, 1, 16), (1, 65, 2, 16), (7, 130, 2, 32), (1, 200, 4, 64),
          (7, 33, 1, 8), (1, 129, 12, 64)]


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
    home = Path(pympar.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(home))
    r = subprocess.run([sys.executable, "-c", PEAK, "4096"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=str(home))
    assert r.returncode == 0, r.stderr[-2000:]
    grew = int(r.stdout.split()[-1])
    linear = 4096 * 2 * 32 * 4 * (3 + 1 + 4)                  # dqkv, o, one thread's scratch: 8 MiB
    assert grew < linear + (4 << 20), grew
    assert grew < 4096 * 4096 * 4 // 4, grew
