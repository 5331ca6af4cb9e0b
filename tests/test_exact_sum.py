"""Reproducible sums (pympar/comm/exact.py): the bits depend only on the multiset of terms.

Terms are drawn across 40 decades with signs, so that float addition in different orders gives
different bits (checked: the plain float sums below disagree); every ordering and grouping of the
exact sum must give the same bits, and within the window (terms within 64 bits of the largest) the
result is the correctly rounded sum, math.fsum's.
"""
import math

import numpy as np
import pytest

from pympar.comm import SelfComm
from pympar.comm.exact import ExactSum, exact_sum


def _terms(dtype, n=12, size=3000, decades=40, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-decades // 2, decades // 2, size)).astype(dtype)
            for _ in range(n)]


def _fsum(terms):
    return np.array([math.fsum(float(t[i]) for t in terms) for i in range(terms[0].size)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_any_order_and_grouping_gives_the_same_bits(dtype):
    terms = _terms(dtype)
    rng = np.random.default_rng(1)
    want = exact_sum(terms)
    plain = [np.sum(np.stack([terms[i] for i in rng.permutation(len(terms))]), axis=0) for _ in range(4)]
    assert any(not np.array_equal(plain[0], p) for p in plain[1:])     # float addition does depend on it
    for _ in range(6):
        order = rng.permutation(len(terms))
        cuts = np.sort(rng.choice(np.arange(1, len(terms)), size=rng.integers(1, 5), replace=False))
        parts = []
        for group in np.split(order, cuts):              # partial sums, as ranks pre-summing their shares
            acc = ExactSum(terms[0].shape, dtype)
            for i in group:
                acc.add(terms[i])
            parts.append(acc)
        first = int(rng.integers(len(parts)))
        total = parts[first].copy()
        for k, p in enumerate(parts):
            if k != first:
                total.merge(p)
        total_bits = total.value()
        assert np.array_equal(total_bits.view(np.uint8), want.view(np.uint8)), (order, cuts)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_terms_within_the_window_sum_to_the_correctly_rounded_value(dtype):
    """Terms spanning 12 decades (40 bits, inside the 64 bits every window keeps): fsum rounded once."""
    terms = _terms(dtype, decades=12, seed=2)
    terms += [-terms[0]]                                  # an exact cancellation too
    got = exact_sum(terms)
    assert np.array_equal(got, _fsum(terms).astype(dtype))


@pytest.mark.parametrize("dtype,kept", [(np.float32, 64), (np.float64, 96)])
def test_what_falls_below_the_window_is_bounded_by_the_largest_term(dtype, kept):
    """Across 40 decades with the largest terms cancelled: parts more than `kept` bits below the
    largest term may be dropped; the error is at most N * 2^-kept of it, plus the final rounding."""
    terms = _terms(dtype, seed=3)
    terms += [-terms[0], -terms[1]]
    got = exact_sum(terms).astype(np.float64)
    ref = _fsum(terms)
    largest = np.abs(np.stack(terms)).max(axis=0).astype(np.float64)
    ulp = np.spacing(np.abs(ref).astype(dtype)).astype(np.float64)
    assert (np.abs(got - ref) <= len(terms) * 2.0 ** -kept * largest + 0.5 * ulp).all()


def test_refusals():
    acc = ExactSum((3,), np.float32)
    with pytest.raises(ValueError, match="does not match"):
        acc.add(np.zeros(3, np.float64))
    with pytest.raises(TypeError, match="float32 or float64"):
        ExactSum((3,), np.float16)
    with pytest.raises(ValueError, match="op='sum'"):
        SelfComm().allreduce(np.ones(3, np.float32), op="prod", reproducible=True)


def test_a_size_one_communicator_returns_the_operand_itself():
    x = _terms(np.float32, n=1)[0]
    assert np.array_equal(SelfComm().allreduce(x, reproducible=True, inplace=False), x)
    rows = SelfComm().reduce_scatter(x.reshape(100, 30), reproducible=True)
    assert np.array_equal(rows, x.reshape(100, 30))


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_same_bits_for_every_world_size_and_algorithm(n):
    from mpirun import run_pytest_mpi
    run_pytest_mpi(n, "mpi_exact.py", timeout=120)


@pytest.mark.parametrize("dtype, kept", [(np.float32, 3), (np.float64, 4)])
def test_the_cpp_kernels_are_the_reference_bit_for_bit(dtype, kept):
    """pympar._C's exact_add, exact_raise and exact_value against the NumPy reference (the path
    without the native module, or PYMPAR_KERNELS=reference): the same integers and the same floats."""
    from pympar import kernels
    from pympar.kernels import native, reference

    if not kernels.native_available():
        pytest.skip("pympar._C is not built")
    rng = np.random.default_rng(4)
    n = 5000
    states = [(np.full(n, reference.EXACT_NONE, np.int32), np.zeros((n, kept), np.int64)) for _ in range(2)]
    for t in _terms(dtype, n=6, size=n, decades=60, seed=5):
        t[::7] = 0
        for impl, (top, bins) in zip((reference, native), states):
            assert impl.exact_add(t, top, bins) == -1
    assert all(np.array_equal(a, b) for a, b in zip(*states))
    new_top = (states[0][0] + rng.integers(0, kept + 1, n)).astype(np.int32)
    outs = []
    for impl, (top, bins) in zip((reference, native), states):
        impl.exact_raise(top, bins, new_top)
        out = np.empty(n)
        impl.exact_value(top, bins, out)
        outs.append(out)
    assert all(np.array_equal(a, b) for a, b in zip(*states))
    assert np.array_equal(outs[0].view(np.int64), outs[1].view(np.int64))
    bad = _terms(dtype, n=1, size=n)[0]
    bad[123] = np.nan
    assert native.exact_add(bad, *states[1]) == reference.exact_add(bad, *states[0]) == 123


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_non_finite_term_makes_its_element_nan_in_any_order(dtype):
    """No exception (a rank raising before a reduction would leave the others waiting): the element
    is NaN however the terms are grouped, the others are unaffected."""
    terms = _terms(dtype, n=4, size=10)
    terms[2][3], terms[1][7] = np.inf, np.nan
    a = exact_sum(terms)
    b = ExactSum((10,), dtype).add(terms[3]).merge(ExactSum((10,), dtype).add(terms[2]).add(terms[1])).add(terms[0])
    got = b.value()
    assert np.isnan(a[3]) and np.isnan(a[7]) and np.isnan(got[3]) and np.isnan(got[7])
    ok = np.ones(10, bool)
    ok[[3, 7]] = False
    assert np.array_equal(a[ok], got[ok]) and np.isfinite(a[ok]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reading_a_sum_changes_nothing_after(dtype):
    """value() normalises a copy: reading a partial sum, then merging or adding a larger term, gives the
    bits of never having read it (a carry moved early would survive the bin a later term pushes out)."""
    small = _terms(dtype, n=6, size=500, decades=4, seed=7)
    big = (np.random.default_rng(8).standard_normal(500) * 2.0 ** 80).astype(dtype)
    a = ExactSum((500,), dtype)
    for t in small:
        a.add(t)
    b = a.copy()
    before = b.bins.copy()
    b.value()
    assert np.array_equal(b.bins, before)
    assert np.array_equal(a.add(big).value(), b.add(big).value())


def test_float64_sums_at_the_edge_of_the_range():
    """The top bin's value never overflows on the way: max + max is inf (IEEE's), and a sum whose
    exact value is finite stays finite; a term far below the largest is dropped, as documented."""
    m = np.finfo(np.float64).max
    assert exact_sum([np.array([m]), np.array([m])])[0] == np.inf
    assert exact_sum([np.array([-m]), np.array([-2.0 ** 969])])[0] == -m
    assert exact_sum([np.array([m]), np.array([-m]), np.array([2.0 ** 960])])[0] == 2.0 ** 960   # in the window
    assert exact_sum([np.array([m]), np.array([-m]), np.array([1.5])])[0] == 0.0    # 1023 bits below: dropped


def test_more_contributions_than_the_bins_hold_are_refused():
    acc = ExactSum((4,), np.float32).add(np.ones(4, np.float32))
    with pytest.raises(OverflowError, match="could overflow"):
        acc._count(2 ** 31)
