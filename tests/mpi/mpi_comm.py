"""Communicator verbs and every algorithm against a NumPy reference, at any world size."""
import os

import numpy as np
import pytest

from pympar import backend
from pympar.comm import MPIComm, SelfComm
from pympar.comm.dtypes import DTYPES, reference_reduce
from pympar.comm.mpi import ALGOS

SLOW = os.environ.get("PYMPAR_TEST_FULL") == "1"
COUNTS = [0, 1, 13, 1009] if SLOW else [0, 1, 13, 131]   # empty, one, prime, non-divisible
DT = DTYPES
OPS = ("sum", "avg", "max", "min")


@pytest.fixture(scope="module")
def comm(mpi_world):
    c = MPIComm(mpi_world, name="test", timeout=60)
    yield c


def data(rank, count, dt, rows_shape=()):
    # small integers: sums over 8 ranks stay exact in float16 and bfloat16
    v = ((np.arange(count) * 3 + rank * 5) % 11 - 5).astype(np.float64)
    return v.astype(backend.dtype(dt))


def tol(dt):
    return 0.05 if backend.is_low_precision(backend.dtype(dt)) else 1e-6


def algos_for(comm, coll):
    return [a for a in ALGOS[coll] if a != "shm" or comm.topology().single_node] + ["auto"]


def test_allreduce_every_algo_dtype_op(comm):
    n, r = comm.size, comm.rank
    for algo in algos_for(comm, "allreduce"):
        for dt in DT:
            for op in OPS:
                for count in COUNTS:
                    want = reference_reduce([data(k, count, dt) for k in range(n)], op)
                    x = data(r, count, dt)
                    out = np.full_like(x, 7)
                    got = comm.allreduce(x, op=op, algo=algo, out=out)
                    assert got is out
                    np.testing.assert_array_equal(x, data(r, count, dt), err_msg="out-of-place changed its input")
                    np.testing.assert_allclose(got.astype(np.float64), want, atol=tol(dt), err_msg=f"{algo} {dt} {op} {count}")
                    y = comm.allreduce(x, op=op, algo=algo)      # in place
                    assert y is x
                    np.testing.assert_allclose(y.astype(np.float64), want, atol=tol(dt), err_msg=f"in-place {algo} {dt} {op} {count}")


def test_allreduce_2d_and_bigger_than_a_ring_segment(comm):
    r, n = comm.rank, comm.size
    x = np.arange(3 * 100_003, dtype=np.float32).reshape(3, -1) % 17 + r
    want = (np.arange(3 * 100_003, dtype=np.float64).reshape(3, -1) % 17) * n + n * (n - 1) / 2
    for algo in algos_for(comm, "allreduce"):
        np.testing.assert_allclose(comm.allreduce(x.copy(), algo=algo), want, err_msg=algo)


def test_reduce_scatter_every_algo(comm):
    n, r = comm.size, comm.rank
    for algo in algos_for(comm, "reduce_scatter"):
        for dt in DT:
            for op in OPS:
                for rows in [n, 2 * n + 1, 1, 0]:
                    x = data(r, rows * 3, dt).reshape(rows, 3)
                    want = reference_reduce([data(k, rows * 3, dt).reshape(rows, 3) for k in range(n)], op)
                    E = np.array_split(np.arange(rows), n)[r]
                    got = comm.reduce_scatter(x, op=op, algo=algo)
                    assert got.shape == (len(E), 3)
                    np.testing.assert_allclose(got.astype(np.float64), want[E], atol=tol(dt), err_msg=f"{algo} {dt} {op} {rows}")


def test_allgather_every_algo(comm):
    n, r = comm.size, comm.rank
    for algo in algos_for(comm, "allgather"):
        for dt in DT:
            for m in [0, 1, 7]:
                x = data(r, 2 * m, dt).reshape(m, 2)
                want = np.concatenate([data(k, 2 * m, dt).reshape(m, 2) for k in range(n)])
                out = comm.allgather(x, algo=algo)
                np.testing.assert_array_equal(out, want, err_msg=f"{algo} {dt} {m}")


def test_broadcast_from_every_root(comm):
    for algo in algos_for(comm, "broadcast"):
        for root in range(comm.size):
            for dt in ("float32", "bfloat16", "int64"):
                for count in (0, 1, 11, 2 * comm.size + 1):
                    x = data(comm.rank, count, dt) if comm.rank == root else np.zeros(count, backend.dtype(dt))
                    got = comm.broadcast(x, root=root, algo=algo)
                    assert got is x
                    np.testing.assert_array_equal(got, data(root, count, dt), err_msg=f"{algo} root={root} {dt} {count}")


def test_alltoall(comm):
    n, r = comm.size, comm.rank
    for algo in ("mpi", "pairwise"):
        for dt in ("float32", "float16", "int32"):
            x = (np.arange(n * 3) + 100 * r).astype(backend.dtype(dt))   # block j -> rank j
            got = comm.alltoall(x, algo=algo)
            want = np.concatenate([np.arange(r * 3, r * 3 + 3) + 100 * j for j in range(n)]).astype(x.dtype)
            np.testing.assert_array_equal(got, want)


def test_alltoallv_with_zero_counts(comm):
    n, r = comm.size, comm.rank
    # rank r sends (r + j) % 3 rows to rank j: some counts are zero; rank 0 sends nothing to itself
    sc = np.array([(r + j) % 3 for j in range(n)])
    rows = [np.full((sc[j], 2), 1000 * r + j, dtype=np.float32) for j in range(n)]
    x = np.concatenate(rows) if sc.sum() else np.empty((0, 2), np.float32)
    for given in (False, True):
        rc_in = np.array([(j + r) % 3 for j in range(n)]) if given else None
        out, rc = comm.alltoallv(x, sc, recv_counts=rc_in)
        assert rc.tolist() == [(j + r) % 3 for j in range(n)]
        want = [np.full(((j + r) % 3, 2), 1000 * j + r, dtype=np.float32) for j in range(n)]
        np.testing.assert_array_equal(out, np.concatenate(want))
    with pytest.raises(ValueError, match="send_counts"):
        comm.alltoallv(x, sc + 1)


def test_point_to_point_ring(comm):
    n, r = comm.size, comm.rank
    for dt in DT:
        x = data(r, 5, dt)
        buf = np.zeros(5, x.dtype)
        got = comm.sendrecv(x, (r + 1) % n, buf, (r - 1) % n, sendtag=3)
        np.testing.assert_array_equal(got, data((r - 1) % n, 5, dt))
    rq = comm.irecv(np.zeros(4), (r - 1) % n, tag=9)
    sq = comm.isend(np.full(4, float(r)), (r + 1) % n, tag=9)
    sq.wait()
    got = rq.wait()
    assert rq.test() and got.tolist() == [float((r - 1) % n)] * 4


def test_progress_moves_sends_and_takes_no_message(comm):
    """progress() (what a NCCL wait calls while pipeline sends are out) probes only: a large
    message sent before it is still received whole afterwards."""
    n, r = comm.size, comm.rank
    x = np.arange(1 << 19, dtype=np.float64) + r          # 4 MiB: past any eager limit
    sq = comm.isend(x, (r + 1) % n, tag=11)
    for _ in range(50):
        comm.progress()
    got = comm.irecv(np.zeros_like(x), (r - 1) % n, tag=11).wait()
    sq.wait()
    np.testing.assert_array_equal(got, np.arange(1 << 19, dtype=np.float64) + (r - 1) % n)


def _progress(req):
    """Drive a request with test() only (as DataParallel's polling does), then wait()."""
    for _ in range(1_000_000):
        if req.test():
            break
    return req.wait()


def test_nonblocking_verbs_match_blocking(comm):
    n, r = comm.size, comm.rank
    for algo in ("auto", "mpi", "ring"):
        for dt in ("float32", "float64", "bfloat16", "int32"):
            for op in ("sum", "avg", "max"):
                if op == "avg" and dt == "int32":
                    continue
                for count in (0, 1, 13, 2 * n + 1):
                    want = reference_reduce([data(k, count, dt) for k in range(n)], op)
                    x = data(r, count, dt)
                    got = _progress(comm.iallreduce(x, op=op, algo=algo, inplace=False))
                    np.testing.assert_array_equal(x, data(r, count, dt))
                    np.testing.assert_allclose(got.astype(np.float64), want, atol=tol(dt), err_msg=f"i {algo} {dt} {op} {count}")
                    rows = want.reshape(count, 1)[np.array_split(np.arange(count), n)[r]]
                    got = comm.ireduce_scatter(x.reshape(count, 1), op=op, algo=algo).wait()
                    np.testing.assert_allclose(got.astype(np.float64), rows, atol=tol(dt), err_msg=f"irs {algo} {dt} {op} {count}")
            for m in (0, 3):
                x = data(r, 2 * m, dt).reshape(m, 2)
                got = _progress(comm.iallgather(x, algo=algo))
                np.testing.assert_array_equal(got, np.concatenate([data(k, 2 * m, dt).reshape(m, 2) for k in range(n)]))
    for root in range(n):
        x = data(r, 9, "float32") if r == root else np.zeros(9, np.float32)
        assert _progress(comm.ibroadcast(x, root=root)) is x
        np.testing.assert_array_equal(x, data(root, 9, "float32"))
    x = (np.arange(n * 3) + 100 * r).astype(np.float32)
    want = np.concatenate([np.arange(r * 3, r * 3 + 3) + 100 * j for j in range(n)]).astype(x.dtype)
    np.testing.assert_array_equal(_progress(comm.ialltoall(x)), want)
    sc = np.array([(r + j) % 3 for j in range(n)])
    xv = np.concatenate([np.full((sc[j], 2), 1000 * r + j, dtype=np.float32) for j in range(n)])
    for given in (None, np.array([(j + r) % 3 for j in range(n)])):
        out, rc = _progress(comm.ialltoallv(xv, sc, recv_counts=given))
        assert rc.tolist() == [(j + r) % 3 for j in range(n)]
        want = [np.full(((j + r) % 3, 2), 1000 * j + r, dtype=np.float32) for j in range(n)]
        np.testing.assert_array_equal(out, np.concatenate(want))
    buf = np.zeros(4)
    got = _progress(comm.isendrecv(np.full(4, float(r)), (r + 1) % n, buf, (r - 1) % n, sendtag=5))
    assert got is buf and buf.tolist() == [float((r - 1) % n)] * 4
    _progress(comm.ibarrier())
    with pytest.raises(ValueError, match="nonblocking form"):
        comm.ibroadcast(np.zeros(2), algo="ring")


def test_nonblocking_overlaps_several_in_flight(comm):
    """Several ring and library requests in flight at once, waited in a different order on
    odd and even ranks (the wait of one must progress the others)."""
    n, r = comm.size, comm.rank
    xs = [np.full(50_000 + k, float(r + k)) for k in range(4)]
    reqs = [comm.iallreduce(x, algo=("ring", "mpi")[k % 2]) for k, x in enumerate(xs)]
    for k in (reversed(range(4)) if r % 2 else range(4)):
        np.testing.assert_allclose(reqs[k].wait(), sum(j + k for j in range(n)))


def test_nonblocking_library_allreduce_and_barrier(comm):
    x = np.full(10, comm.rank + 1.0)
    req = comm.iallreduce(x, op="avg")
    comm.barrier()
    np.testing.assert_allclose(req.wait(), (comm.size + 1) / 2)


def test_split_into_even_and_odd(comm):
    sub = comm.split(comm.rank % 2, name="parity")
    members = sub.allgather(np.array([comm.rank]))
    assert members.tolist() == list(range(comm.rank % 2, comm.size, 2))
    assert comm.split(None) is None  # every rank must call split: color None opts out
    x = np.arange(5.0) + comm.rank
    want = sum(np.arange(5.0) + k for k in range(comm.rank % 2, comm.size, 2))
    np.testing.assert_allclose(sub.allreduce(x, algo="ring"), want)


def test_user_mpi4py_messages_are_not_confused(mpi_world, comm):
    """A pending message on the user's own communicator does not match pympar's traffic."""
    n, r = comm.size, comm.rank
    if n == 1:
        return
    mpi_world.Isend(np.array([42.0]), (r + 1) % n, tag=0)
    x = np.ones(3)
    comm.allreduce(x, algo="ring")
    got = np.zeros(1)
    mpi_world.Recv(got, (r - 1) % n, tag=0)
    assert got[0] == 42.0 and (x == n).all()


def test_bad_arguments_raise_clearly(comm):
    with pytest.raises(ValueError, match="unknown reduction op"):
        comm.allreduce(np.ones(2), op="mean")
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        comm.allreduce(np.ones(2), algo="butterfly")
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.allreduce(np.ones((4, 4))[:, 1])
    with pytest.raises(TypeError, match="not supported"):
        comm.allreduce(np.ones(2, dtype=np.complex64))


def test_selfcomm_same_answers():
    s = SelfComm()
    x = np.arange(6.0).reshape(3, 2)
    assert s.allreduce(x.copy(), op="avg").tolist() == x.tolist()
    assert s.reduce_scatter(x).tolist() == x.tolist()
    assert s.allgather(x).tolist() == x.tolist()
    out, rc = s.alltoallv(x, [3])
    assert out.tolist() == x.tolist() and rc.tolist() == [3]
    s.send(x, 0, tag=1)
    assert s.recv(np.zeros_like(x), 0, tag=1).tolist() == x.tolist()


def test_hierarchical_on_a_permuted_communicator(mpi_world):
    """Ranks ordered evens first (world 0, 2, 4, ..., 1, 3, ...): under PYMPAR_RANKS_PER_NODE a
    node's ranks are not contiguous in this communicator."""
    n, w = mpi_world.Get_size(), mpi_world.Get_rank()
    sub = MPIComm(mpi_world.Split(0, (w % 2) * n + w // 2), name="permuted", timeout=60, _owned=True)
    r = sub.rank
    for algo in ("hierarchical", "auto"):
        x = (np.arange(2 * n + 3, dtype=np.float64) * (r + 1)).reshape(-1, 1)
        rows = np.array_split(np.arange(2 * n + 3), n)[r]
        np.testing.assert_allclose(sub.reduce_scatter(x, algo=algo)[:, 0], rows * n * (n + 1) / 2, err_msg=algo)
        got = sub.allgather(np.full((2, 3), r, dtype=np.float32), algo=algo)
        assert got[:, 0].tolist() == [k for k in range(n) for _ in range(2)], algo
        np.testing.assert_allclose(sub.allreduce(np.full(5, r + 1.0), algo=algo), n * (n + 1) / 2)


def test_nonblocking_tags_wrap_and_refuse_a_tag_in_use(mpi_world):
    """pympar's nonblocking algorithms tag each call's messages 1 + (seq - 1) mod the MPI
    library's tag space: past its end the tags wrap and the results stay right; a call whose tag
    an unfinished earlier call still holds is refused before it counts, naming both."""
    c = MPIComm(mpi_world, name="tags", timeout=60)
    assert c._tag_span >= 32767                       # MPI's guaranteed TAG_UB
    if c.size == 1:
        return                                        # one rank: no messages, no tags
    c._tag_span = 3                                   # a tiny tag space, to cross its end
    n, r = c.size, c.rank
    for k in range(7):                                # tags 1, 2, 3, 1, 2, ...: each finished first
        np.testing.assert_allclose(c.iallreduce(np.full(5, r + k, float), algo="ring").wait(), n * k + n * (n - 1) / 2)
    # rank 0 starts three calls while no other rank has: none can finish, their 3 tags are held
    if r > 0:
        mpi_world.recv(source=0, tag=77)
    pending = [c.iallreduce(np.full(4, float(r)), algo="ring") for _ in range(3)]
    if r == 0:
        with pytest.raises(RuntimeError, match=r"tags: nonblocking iallreduce #11 would reuse the message tag of "
                                               r"#8, still unfinished 3 calls later .*tag space is 1\.\.3"):
            c.iallreduce(np.full(4, 0.0), algo="ring")
        for q in range(1, n):
            mpi_world.send(None, dest=q, tag=77)
    for q in pending:
        np.testing.assert_allclose(q.wait(), n * (n - 1) / 2)
    np.testing.assert_allclose(c.iallreduce(np.ones(3), algo="ring").wait(), n)      # the refused call did not count
    lib, ring = c.iallreduce(np.ones(3), algo="mpi"), c.iallreduce(np.ones(3), algo="ring")
    assert (lib.tagged, ring.tagged) == (False, True)  # the library's own calls hold no pympar tag
    lib.wait(), ring.wait()
    c.free()


def test_host_staging_passes_host_operands_through(comm):
    """HostStaging (the wrapper that stages device operands through the host, see
    test_gpu_engine.py for that part) hands host operands to the wrapped communicator unchanged:
    every verb gives the wrapped one's answer, in the same buffers; split wraps the sub-communicator
    and the rest (topology, candidates, barrier) is the wrapped communicator's."""
    from pympar.comm import HostStaging

    c, n, r = HostStaging(comm), comm.size, comm.rank
    assert (c.rank, c.size, c.name) == (r, n, comm.name) and c.topology() is comm.topology()
    assert c.candidates("allreduce") == comm.candidates("allreduce")
    x = np.full(5, float(r + 1))
    assert c.allreduce(x) is x and x.tolist() == [n * (n + 1) / 2] * 5
    out = np.zeros(3)
    assert c.iallreduce(np.ones(3), out=out, algo="ring").wait() is out and out.tolist() == [float(n)] * 3
    np.testing.assert_array_equal(c.allgather(np.array([r])), np.arange(n))
    np.testing.assert_array_equal(c.iallgather(np.array([r]), algo="ring").wait(), np.arange(n))
    np.testing.assert_array_equal(c.reduce_scatter(np.ones((n, 2))), np.full((1, 2), float(n)))
    np.testing.assert_array_equal(c.ireduce_scatter(np.ones((n, 2))).wait(), np.full((1, 2), float(n)))
    b = np.full(2, float(r))
    assert c.broadcast(b, root=n - 1) is b and b.tolist() == [float(n - 1)] * 2
    b = np.full(2, float(r))
    assert c.ibroadcast(b, root=0).wait() is b and b.tolist() == [0.0] * 2
    a = np.arange(n, dtype=np.float64) + 10 * r
    np.testing.assert_array_equal(c.alltoall(a), 10 * np.arange(n) + r)
    np.testing.assert_array_equal(c.ialltoall(a).wait(), 10 * np.arange(n) + r)
    rows, rc = c.alltoallv(np.full((n, 1), float(r)), np.ones(n, np.int64))
    assert rc.tolist() == [1] * n and rows[:, 0].tolist() == [float(k) for k in range(n)]
    rows, rc = c.ialltoallv(np.full((n, 1), float(r)), np.ones(n, np.int64)).wait()
    assert rows[:, 0].tolist() == [float(k) for k in range(n)]
    buf = np.zeros(2)
    assert c.sendrecv(np.full(2, float(r)), (r + 1) % n, buf, (r - 1) % n) is buf
    assert buf.tolist() == [float((r - 1) % n)] * 2
    sub = c.split(r % 2, name="parity")
    assert isinstance(sub, HostStaging) and sub.size == len(range(r % 2, n, 2))
    sub.free()
    c.barrier()
