"""The GEMM library under pympar's NumPy products (pympar/kernels/gemm.py): MKL where installed,
NumPy's BLAS otherwise or when asked. MKL's products equal a float64 reference for every operand
layout pympar passes, the layouts MKL cannot take go to NumPy, and a model trains to the same
numbers (float tolerance) on either library."""
from __future__ import annotations

import numpy as np
import pytest

from pympar import kernels
from pympar.config import ConfigError, apply_environment
from pympar.kernels import gemm
from pympar.nn import GPT, GPTConfig
from pympar.nn.products import matmul

needs_mkl = pytest.mark.skipif(not gemm._load(), reason="MKL is not installed (pip install 'pympar[mkl]')")


@pytest.fixture
def library():
    """Restores the selection and the thread count after the test."""
    before, threads = gemm._choice, kernels.get_num_threads()
    yield gemm
    gemm.use(before)
    kernels.set_num_threads(threads)


def _layouts(rng, M, K, N, dtype):
    a = rng.standard_normal((M, K)).astype(dtype)
    b = rng.standard_normal((K, N)).astype(dtype)
    wide = rng.standard_normal((M, K + 7)).astype(dtype)[:, 3:3 + K]     # rows of a wider array
    return [("C", a, b), ("a^T", np.ascontiguousarray(a.T).T, b), ("b^T", a, np.ascontiguousarray(b.T).T),
            ("both^T", np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T), ("strided rows", wide, b)]


@needs_mkl
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-6), (np.float64, 1e-13)])
@pytest.mark.parametrize("threads", [1, 2])
def test_mkl_products_equal_the_reference(library, dtype, tol, threads):
    library.use("mkl")
    kernels.set_num_threads(threads)
    rng = np.random.default_rng(0)
    for (M, K, N) in [(257, 129, 65), (1024, 64, 192), (96, 200, 513), (3, 5, 2), (64, 1000, 16)]:
        for name, a, b in _layouts(rng, M, K, N, dtype):
            ref = a.astype(np.float64) @ b.astype(np.float64)
            scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)   # the sum's magnitude
            y = gemm.product(a, b, threads=threads)
            assert y is not None, (name, M, K, N)
            assert y.dtype == dtype and y.shape == (M, N)
            assert np.all(np.abs(y - ref) <= tol * scale), (name, M, K, N, float(np.max(np.abs(y - ref) / scale)))
            big = np.full((M + 2, N + 5), -7.0, dtype)          # into a block of a larger array
            out = big[1:M + 1, 2:N + 2]
            assert matmul(a, b, out=out) is out
            assert np.array_equal(out, y)
            assert np.all(big[0] == -7) and np.all(big[:, :2] == -7) and np.all(big[:, N + 2:] == -7)


@pytest.mark.parametrize("choice", ["mkl", "numpy"])
@pytest.mark.parametrize("threads", [1, 2])
def test_accumulate_adds_the_product_to_out(library, choice, threads):
    """matmul(accumulate=True): out += a @ b for every layout, in place (a block of a larger
    array; nothing around it touched), on MKL by the GEMM itself (beta = 1), on NumPy through the
    product; an out in a wider dtype (a float32 gradient of bfloat16-style products) and an out
    MKL cannot write take the fallback; no out is an error."""
    if choice == "mkl" and not gemm._load():
        pytest.skip("MKL is not installed")
    library.use(choice)
    kernels.set_num_threads(threads)
    rng = np.random.default_rng(5)
    for (M, K, N) in [(257, 129, 65), (96, 200, 513), (3, 5, 2)]:
        for name, a, b in _layouts(rng, M, K, N, np.float32):
            c0 = rng.standard_normal((M, N)).astype(np.float32)
            ref = c0.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
            scale = np.abs(c0) + np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
            big = np.full((M + 2, N + 5), -7.0, np.float32)
            out = big[1:M + 1, 2:N + 2]
            out[...] = c0
            assert matmul(a, b, out=out, accumulate=True) is out
            assert np.all(np.abs(out - ref) <= 4e-6 * scale), (name, M, K, N)
            assert np.all(big[0] == -7) and np.all(big[:, :2] == -7) and np.all(big[:, N + 2:] == -7)
            if choice == "mkl":                  # MKL took it (not the fallback)
                again = c0.copy()
                assert gemm.product(a, b, out=again, threads=threads, accumulate=True) is again
                assert np.array_equal(again, out)
    a = rng.standard_normal((32, 16)).astype(np.float32)
    b = rng.standard_normal((16, 8)).astype(np.float32)
    wide = np.ones((32, 8), np.float64)
    matmul(a, b, out=wide, accumulate=True)      # another dtype: the product, widened, then added
    assert np.array_equal(wide, 1.0 + (a @ b).astype(np.float64))
    strided = np.ones((32, 16), np.float32)[:, ::2]
    assert gemm.product(a, b, out=strided, accumulate=True) is None
    matmul(a, b, out=strided, accumulate=True)
    assert np.allclose(strided, 1.0 + a @ b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="accumulate=True needs an out"):
        matmul(a, b, accumulate=True)
    with pytest.raises(ValueError, match="accumulate=True needs an out"):
        gemm.product(a, b, accumulate=True)


def test_product_grad_writes_then_adds(library):
    """nn.wgrad.product_grad: the step's first contribution is written into the gradient
    (whatever was there), the next one added; deferred inside a WeightGrads scope until run()."""
    from pympar.nn.parameter import make_param
    from pympar.nn.wgrad import WeightGrads, product_grad
    p = make_param(0, "w", (24, 40), np.float32, 0.02)
    p.grad[...] = 123.0
    p.zero_grad()                                # the next write replaces the 123s
    rng = np.random.default_rng(6)
    a1, b1 = rng.standard_normal((24, 64)).astype(np.float32), rng.standard_normal((64, 40)).astype(np.float32)
    a2, b2 = rng.standard_normal((24, 16)).astype(np.float32), rng.standard_normal((16, 40)).astype(np.float32)
    product_grad(p, a1, b1)
    assert np.allclose(p.grad, a1 @ b1, rtol=1e-5, atol=1e-5)
    with WeightGrads() as w:
        product_grad(p, a2, b2)
        assert np.allclose(p.grad, a1 @ b1, rtol=1e-5, atol=1e-5)     # not yet
    w.run()
    assert np.allclose(p.grad, a1 @ b1 + a2 @ b2, rtol=1e-5, atol=1e-5)


@needs_mkl
@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_from_python_equal_blocks_from_cpp(library, monkeypatch, threads):
    """The two ways to call a product's blocks -- _C.gemm_blocks (the kernel threads, no GIL)
    and, without the C++ module, a Python call per block through blas.over_chunks -- make the
    same MKL calls on the same blocks, so the same bits, written and accumulated."""
    library.use("mkl")
    kernels.set_num_threads(threads)
    assert gemm._blocks is not None
    rng = np.random.default_rng(7)
    for (M, K, N) in [(257, 129, 65), (96, 200, 513), (1024, 64, 192)]:
        for name, a, b in _layouts(rng, M, K, N, np.float32):
            c0 = rng.standard_normal((M, N)).astype(np.float32)
            got = {}
            for way in ("cpp", "python"):
                if way == "python":
                    monkeypatch.setattr(gemm, "_blocks", None)
                y = gemm.product(a, b, threads=threads)
                acc = c0.copy()
                gemm.product(a, b, out=acc, threads=threads, accumulate=True)
                got[way] = (y, acc)
                monkeypatch.undo()
            assert np.array_equal(got["cpp"][0], got["python"][0]), (name, M, K, N)
            assert np.array_equal(got["cpp"][1], got["python"][1]), (name, M, K, N)


@needs_mkl
def test_what_mkl_cannot_take_goes_to_numpy(library):
    library.use("mkl")
    rng = np.random.default_rng(1)
    a = rng.standard_normal((32, 16)).astype(np.float32)
    b = rng.standard_normal((16, 16)).astype(np.float32)
    cases = [
        (a[:, ::2], b[::2]),                                  # a: no unit stride either way
        (a.astype(np.float16), b.astype(np.float16)),         # not float32/float64
        (a, b.astype(np.float64)),                            # mixed dtypes
        (a[None].repeat(2, 0), b),                            # a stack (attention's materialized path)
        (a[:, :1], b[:1]),                                    # one-wide
    ]
    for x, w in cases:
        assert gemm.product(x, w) is None
        y = matmul(x, w)
        # float32 accumulation over K = 16 terms: within gamma_16 ~ 16 u32 of the exact sum, relative to
        # sum |x_i w_i| (Higham 3.1); a float16 product is then rounded once more (u16 = 2^-11)
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        bound = (16 * 2.0 ** -24 + (2.0 ** -11 if y.dtype == np.float16 else 0)) * (np.abs(x64) @ np.abs(w64))
        assert np.all(np.abs(y.astype(np.float64) - x64 @ w64) <= bound), x.dtype
    sq = rng.standard_normal((16, 16)).astype(np.float32)
    ref = sq @ b
    assert gemm.product(sq, b, out=sq) is None                # out aliases an operand: NumPy buffers it
    assert np.array_equal(matmul(sq, b, out=sq), ref)
    assert gemm.product(a, b, out=np.empty((32, 16), np.float64)) is None   # out of another dtype


def test_numpy_selected_runs_numpy(library):
    library.use("numpy")
    assert library.active() == "numpy" and "NumPy" in library.describe()
    a = np.ones((64, 32), np.float32)
    assert library.product(a, a.T) is None
    assert np.array_equal(matmul(a, a.T), a @ a.T)


def test_selection_is_checked(library, monkeypatch):
    with pytest.raises(ValueError, match="expected one of auto, numpy, mkl"):
        library.use("openblas")
    with pytest.raises(ConfigError, match="PYMPAR_GEMM='fast'"):
        apply_environment({"PYMPAR_GEMM": "fast"})
    apply_environment({"PYMPAR_GEMM": "numpy"})
    assert library.active() == "numpy"
    # where no libmkl_rt can be found: "mkl" is refused with what was looked for, "auto" is NumPy
    monkeypatch.setattr(library, "_lib", None)
    monkeypatch.setattr(library, "_where", library._where)
    monkeypatch.setattr(library, "candidates", lambda: [])
    with pytest.raises(ConfigError, match="PYMPAR_GEMM=mkl: .*libmkl_rt not found.*PYMPAR_GEMM=numpy"):
        apply_environment({"PYMPAR_GEMM": "mkl"})
    library.use("auto")
    assert library.active() == "numpy" and library.describe() == "NumPy's BLAS (no MKL found)"


def _step(dtype):
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg, seed=3, dtype=dtype)
    x = np.random.default_rng(5).integers(0, 64, size=(3, 33))
    model.zero_grad()
    loss = model.loss_and_grad(x[:, :-1], x[:, 1:])
    loss = loss[0] if isinstance(loss, tuple) else loss
    return float(loss), {n: p.grad.copy() for n, p in model.named_parameters()}


@needs_mkl
@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-4), (np.float64, 1e-11)])
def test_a_model_trains_to_the_same_numbers_on_either_library(library, dtype, rtol):
    library.use("numpy")
    loss_np, g_np = _step(dtype)
    library.use("mkl")
    loss_mkl, g_mkl = _step(dtype)
    assert abs(loss_mkl - loss_np) <= rtol * abs(loss_np)
    for n in g_np:
        scale = float(np.max(np.abs(g_np[n])))
        assert np.max(np.abs(g_mkl[n] - g_np[n])) <= rtol * scale, n
    loss_again, g_again = _step(dtype)                     # one library, the same bits every time
    assert loss_again == loss_mkl and all(np.array_equal(g_again[n], g_mkl[n]) for n in g_mkl)
