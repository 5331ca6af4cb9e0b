"""The grouped expert call (csrc/grouped.cpp) against the per-expert loop it replaces: the same
products on the same operands, so the same bits, forward and backward, in float32 and float64, at
1 and 2 kernel threads, with groups cut into MLP blocks, empty groups, a second micro-batch's
gradients added; under a deferred W pass the grouped backward makes the weight gradients at once."""
import numpy as np
import pytest

from pympar import kernels
from pympar.backend import bfloat16
from pympar.kernels import gemm
from pympar.nn import layers
from pympar.nn.moe import MoE
from pympar.nn.products import compute_copies
from pympar.nn.wgrad import WeightGrads

pytestmark = pytest.mark.skipif(not kernels.native_available() or gemm.gemm_address(np.float32) is None,
                                reason="the grouped call needs the C++ module and MKL (the loop runs otherwise)")

# rows per expert: uneven, an empty group, groups over the block size (set to 16 below)
COUNTS = [5, 0, 37, 2, 16, 3, 2, 9]


def _moe(dtype, grouped, bias=True, C=12):
    """dtype bfloat16: float32 parameters, bf16 compute (the trainer's --dtype bfloat16)."""
    lowp = dtype == "bfloat16"
    pdt = np.float32 if lowp else dtype
    m = MoE(C, len(COUNTS), name="moe", top_k=2, seed=4, dtype=pdt, bias=bias,
            compute_dtype=bfloat16 if lowp else None)
    rng = np.random.default_rng(1)
    for _, p in m.named_parameters():                # away from the zero biases of the init
        p.data[...] += (0.05 * rng.standard_normal(p.data.shape)).astype(pdt)
    m.grouped = grouped
    return m


def _run(dtype, grouped, threads, counts=COUNTS, bias=True, defer=False):
    kernels.set_num_threads(threads)
    m = _moe(dtype, grouped, bias)
    rng = np.random.default_rng(2)
    M, C = sum(counts), m.experts[0].c_fc.weight.shape[1]
    outs = []
    adt = bfloat16 if dtype == "bfloat16" else dtype
    for mb in range(2):                              # two micro-batches: the second adds to the gradients
        xs = rng.standard_normal((M, C)).astype(adt)
        dys = rng.standard_normal((M, C)).astype(adt)
        ys, ctx = m.run_experts(xs, np.array(counts))
        assert (ctx[0] == "grouped") == grouped
        if defer:
            with WeightGrads() as w:
                dxs = m.run_experts_backward(dys, ctx)
            w.run()
        else:
            dxs = m.run_experts_backward(dys, ctx)
        outs += [ys, dxs]
    return outs + [p.grad.copy() for n, p in m.named_parameters() if n.startswith("experts.")]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(layers, "MLP_ROWS", 16)     # groups of 37 rows run as 16 + 16 + 5
    yield
    kernels.set_num_threads(1)


# bf16 experts run grouped on each of pympar's bf16 kernels this machine runs (AMX tiles, AVX512-BF16
# dot products; an AMX CPU runs both), the per-expert loop elsewhere
ENGINES = [pytest.param(e, marks=pytest.mark.skipif(gemm._engine(e) is None, reason=f"the {e} engine cannot run here"))
           for e in gemm.OWN_BF16]


@pytest.fixture
def bf16_engine():
    """Select a bf16 engine for the test, restoring the choice after it."""
    before = gemm._bf16_choice
    yield gemm.use_bf16
    gemm.use_bf16(before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, *(pytest.param(f"bfloat16-{p.values[0]}", marks=p.marks)
                                                             for p in ENGINES)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_experts_are_the_loop_bit_for_bit(dtype, threads, bias, bf16_engine):
    if isinstance(dtype, str):
        dtype, engine = dtype.split("-")
        bf16_engine(engine)
    loop, grouped = _run(dtype, False, threads, bias=bias), _run(dtype, True, threads, bias=bias)
    assert len(loop) == len(grouped) == 4 + (4 if bias else 2) * len(COUNTS)
    for a, b in zip(loop, grouped):
        np.testing.assert_array_equal(a, b)
    assert np.any(loop[-1] != 0)                     # gradients were made (the last expert has rows)


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_grouped_reads_the_packed_weights_the_loop_reads(engine, bf16_engine):
    """Inside a step's weight-cache scope the bf16 copies are packed once (kernels/gemm.py) and both
    ways multiply by the packs: still the loop's bits."""
    bf16_engine(engine)
    with compute_copies():
        loop = _run("bfloat16", False, 2)
    with compute_copies():
        grouped = _run("bfloat16", True, 2)
    for a, b in zip(loop, grouped):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("counts", [COUNTS, [1, 3, 1, 0, 1, 2, 1, 17]], ids=["uneven", "one-row"])
def test_a_deferred_w_pass_gives_the_same_bits(counts):
    """A zero-bubble schedule's backward (inside WeightGrads, W run later) and the plain backward
    give the same bits, one-row groups and blocks included; the grouped call ran in both."""
    now, later = _run(np.float32, True, 2, counts), _run(np.float32, True, 2, counts, defer=True)
    for a, b in zip(now, later):
        np.testing.assert_array_equal(a, b)


def test_one_row_groups_within_the_float32_bound():
    """A one-row product the loop hands to NumPy's BLAS (gemm.product takes two or more rows), the
    grouped call to MKL: the two sum each dot product of length K <= 4C in their own order, so they
    may differ by the forward error bound gamma_K * sum |a_i b_i| of each; checked through the MLP
    at 4 gamma_K of the magnitude (two products in series each way)."""
    counts = [1, 3, 1, 0, 1, 2, 1, 1]
    loop, grouped = _run(np.float32, False, 1, counts), _run(np.float32, True, 1, counts)
    K = 4 * 12
    gamma = K * np.finfo(np.float32).eps / 2 / (1 - K * np.finfo(np.float32).eps / 2)
    for a, b in zip(loop, grouped):
        scale = float(np.max(np.abs(a))) or 1.0
        assert float(np.max(np.abs(a - b))) <= 4 * gamma * scale * K


def test_grouped_is_not_taken_where_it_does_not_apply():
    m = _moe(np.float32, True)
    xs = np.ones((sum(COUNTS), 12), np.float32)
    assert m.run_experts(xs, np.array(COUNTS))[1][0] == "grouped"
    m.grouped = False
    assert m.run_experts(xs, np.array(COUNTS))[1][0] != "grouped"
    m = _moe(np.float32, True)
    m.experts[0].c_fc._cdt = np.dtype("float32")    # any compute dtype: the loop (bf16 products)
    assert m._grouped_fn(xs, m.experts) is None
