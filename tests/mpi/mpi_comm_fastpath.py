"""The chunked shared-memory allreduce around chunk boundaries, and allreduce's cached plans."""
import numpy as np
import pytest

from pympar import backend
from pympar.comm import MPIComm
from pympar.comm.algorithms import shm
from pympar.comm.dtypes import DTYPES, reference_reduce

OPS = ("sum", "avg", "max", "min")


@pytest.fixture(scope="module")
def comm(mpi_world):
    c = MPIComm(mpi_world, name="fastpath", timeout=60)
    if not c.topology().single_node and c.size > 1:
        pytest.skip("shm needs one node")
    yield c


def data(rank, count, dt):
    # small integers: sums stay exact in float16/bfloat16; rank-dependent so max/min differ by rank
    v = ((np.arange(count) * 7 + rank * 3) % 13 - 6).astype(np.float64)
    return v.astype(backend.dtype(dt))


def tol(dt):
    return 0.05 if backend.is_low_precision(backend.dtype(dt)) else 1e-6


def test_chunked_shm_allreduce_around_chunk_boundaries(comm, monkeypatch):
    n, r = comm.size, comm.rank
    monkeypatch.setattr(shm, "CHUNK_BYTES", 256)          # chunks of a few dozen elements
    for dt in DTYPES:
        C = shm.chunk_elements(backend.dtype(dt).itemsize, n)
        # one chunk short/exact/over, two and three chunks (slot reuse), a prime count of chunks+tail
        for count in (1, C - 1, C, C + 1, 2 * C - 1, 2 * C + 1, 3 * C + 7, 5 * C + 3):
            for op in OPS:
                want = reference_reduce([data(k, count, dt) for k in range(n)], op)
                x = data(r, count, dt)
                out = np.full_like(x, 9)
                comm.allreduce(x, op=op, algo="shm", out=out)
                np.testing.assert_array_equal(x, data(r, count, dt), err_msg="out-of-place changed its input")
                np.testing.assert_allclose(out.astype(np.float64), want, atol=tol(dt), err_msg=f"{dt} {op} {count} out")
                y = data(r, count, dt)
                assert comm.allreduce(y, op=op, algo="shm") is y
                np.testing.assert_allclose(y.astype(np.float64), want, atol=tol(dt), err_msg=f"{dt} {op} {count} in")


def test_chunked_shm_interleaved_with_other_shm_verbs(comm, monkeypatch):
    # successive calls reuse the window: a fast rank's next call must not overwrite what a slow
    # rank still reads (alternating regions + counters); vary sizes so chunks and regions mix
    n, r = comm.size, comm.rank
    monkeypatch.setattr(shm, "CHUNK_BYTES", 512)
    for it in range(6):
        count = 300 + 97 * it
        x = data(r + it, count, "float32")
        got = comm.allreduce(x.copy(), algo="shm")
        np.testing.assert_allclose(got, reference_reduce([data(k + it, count, "float32") for k in range(n)], "sum"))
        g = comm.allgather(np.full(5, r + it, np.int64), algo="shm")
        np.testing.assert_array_equal(g, np.repeat(np.arange(n) + it, 5))
        b = np.full(count, r, np.float64)
        comm.broadcast(b, root=it % n, algo="shm")
        np.testing.assert_array_equal(b, it % n)


def test_cached_plan_keeps_every_check(comm):
    n, r = comm.size, comm.rank
    for algo in ("mpi", "auto", "shm", "recursive_doubling"):
        for _ in range(3):                            # the 2nd and 3rd calls take the cached plan
            x = np.full(10, r + 1.0, np.float32)
            comm.allreduce(x, algo=algo)
            np.testing.assert_allclose(x, n * (n + 1) / 2)
        x = np.full(10, r + 1.0, np.float32)
        y = comm.allreduce(x, algo=algo, inplace=False)
        assert y is not x and np.all(x == r + 1) and np.allclose(y, n * (n + 1) / 2)
        a = comm.allreduce(np.full((2, 5), r + 1.0, np.float32), op="avg", algo=algo)
        assert a.shape == (2, 5) and np.allclose(a, (n + 1) / 2)
        with pytest.raises(ValueError, match="out has shape"):
            comm.allreduce(x, algo=algo, out=np.empty(10, np.float64))
        with pytest.raises(ValueError, match="out has shape"):
            comm.allreduce(x, algo=algo, out=np.empty(11, np.float32))
        with pytest.raises(ValueError, match="C-contiguous"):
            comm.allreduce(np.zeros(20, np.float32)[::2], algo=algo)
    seq = comm.seq
    comm.allreduce(np.ones(10, np.float32), algo="mpi")
    assert comm.seq == seq + 1, "the fast path must count the collective for the watchdog"
    assert comm._board.slots[0] == comm.seq


def test_plan_is_per_op_and_dtype(comm):
    n, r = comm.size, comm.rank
    for dt in DTYPES:
        for op in OPS:
            for _ in range(2):
                x = data(r, 33, dt)
                comm.allreduce(x, op=op, algo="mpi")
                want = reference_reduce([data(k, 33, dt) for k in range(n)], op)
                np.testing.assert_allclose(x.astype(np.float64), want, atol=tol(dt), err_msg=f"{dt} {op}")
