"""Reproducible sums across ranks (pympar/comm/exact.py), inside every rank of one launch.

Twelve float32 (and float64) terms spanning 40 decades, the same on every rank: rank r pre-sums
terms r, r + p, ... exactly and the ranks' partial sums are reduced, with every allreduce and
reduce_scatter algorithm this communicator offers; the bits must equal the single process's exact
sum of all twelve. The launch runs at 1, 2, 3 and 4 ranks, so the result is the same for every
world size and algorithm. The per-call path (allreduce(x, reproducible=True), each rank one
term) equals the exact sum of the p terms, and its reduce_scatter the rows of it.
"""
import numpy as np
import pytest

from pympar.comm import MPIComm
from pympar.comm.exact import ExactSum, exact_sum


def terms(dtype):
    rng = np.random.default_rng(42)
    return [(rng.standard_normal(600) * 10.0 ** rng.integers(-20, 20, 600)).astype(dtype) for _ in range(12)]


@pytest.fixture(scope="module")
def comm(mpi_world):
    return MPIComm(mpi_world, name="exact", timeout=60)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_sum_of_partial_sums_is_the_single_process_sum_with_every_algorithm(comm, dtype):
    ts = terms(dtype)
    want = exact_sum(ts)
    algos = [a for a in comm.candidates("allreduce") if a != "blocking"]
    for algo in algos:
        acc = ExactSum(ts[0].shape, dtype)
        for t in ts[comm.rank::comm.size]:
            acc.add(t)
        got = acc.allreduce(comm, algo=algo).value()
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), algo
    for algo in [a for a in comm.candidates("reduce_scatter") if a != "blocking"]:
        acc = ExactSum((60, 10), dtype)
        for t in ts[comm.rank::comm.size]:
            acc.add(t.reshape(60, 10))
        rows = acc.reduce_scatter(comm, algo=algo).value()
        lo = sum(60 // comm.size + (i < 60 % comm.size) for i in range(comm.rank))
        assert np.array_equal(rows, want.reshape(60, 10)[lo:lo + rows.shape[0]]), algo


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_reproducible_call_sums_the_ranks_operands_exactly(comm, dtype):
    ts = terms(dtype)
    want = exact_sum(ts[:comm.size])
    x = ts[comm.rank].copy()
    assert np.array_equal(comm.allreduce(x, reproducible=True, inplace=False), want)
    comm.allreduce(x, reproducible=True)                         # in place
    assert np.array_equal(x, want)
    rows = comm.reduce_scatter(ts[comm.rank].reshape(60, 10), reproducible=True)
    lo = sum(60 // comm.size + (i < 60 % comm.size) for i in range(comm.rank))
    assert np.array_equal(rows, want.reshape(60, 10)[lo:lo + rows.shape[0]])


def test_a_nan_on_one_rank_is_nan_everywhere_and_nobody_waits(comm):
    """A non-finite operand on one rank: that element is NaN on every rank, the rest exact, and no
    rank raises before the reductions (the others would wait there for it)."""
    ts = terms(np.float32)
    x = ts[comm.rank].copy()
    if comm.rank == comm.size - 1:
        x[5] = np.nan
    got = comm.allreduce(x, reproducible=True, inplace=False)
    want = exact_sum(ts[:comm.size])
    assert np.isnan(got[5]) == (True if comm.size >= 1 else False)
    keep = np.arange(600) != 5
    assert np.array_equal(got[keep], want[keep])
