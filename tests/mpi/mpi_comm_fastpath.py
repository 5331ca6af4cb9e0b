"""The chunked shared-memory allreduce around chunk boundaries, and the cached plans of the
blocking verbs (allreduce, reduce_scatter, allgather, broadcast, alltoall): planned calls
against the general path, keys that must not reuse a plan, the watchdog on planned calls."""
import time

import numpy as np
import pytest

from pympar import backend
from pympar.comm import CommTimeoutError, MPIComm, fastcoll
from pympar.comm.algorithms import shm
from pympar.comm.dtypes import DTYPES, reference_reduce
from pympar.comm.mpi import ALGOS
from pympar.comm import progress, settings, watchdog
from pympar.comm.watchdog import op_code

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
    monkeypatch.setattr(settings.SETTINGS, "shm_chunk", 256)   # chunks of a few dozen elements
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
    monkeypatch.setattr(settings.SETTINGS, "shm_chunk", 512)
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


# --- the plan of every blocking verb: planned calls against the general path ----------------
VERBS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall")
REDUCTIONS = ("allreduce", "reduce_scatter")


def algos_for(comm, verb):
    return [a for a in ALGOS[verb] if a != "shm" or comm.topology().single_node] + ["auto"]


def operand(verb, rank, n, dt, rows=None):
    """This rank's x of a verb: (rows, 3); rows default to a shape each verb accepts."""
    rows = rows if rows is not None else {"allreduce": 5, "reduce_scatter": 2 * n + 1, "allgather": 2,
                                          "broadcast": 3, "alltoall": 2 * n}[verb]
    return data(rank, rows * 3, dt).reshape(rows, 3)


def expected(verb, n, r, dt, op, root, rows=None):
    xs = [operand(verb, k, n, dt, rows) for k in range(n)]
    if verb == "allreduce":
        return reference_reduce(xs, op)
    if verb == "reduce_scatter":
        return reference_reduce(xs, op)[np.array_split(np.arange(xs[0].shape[0]), n)[r]]
    if verb == "allgather":
        return np.concatenate(xs)
    if verb == "broadcast":
        return xs[root]
    m = xs[0].shape[0] // n                                  # alltoall: block r of every rank
    return np.concatenate([x[r * m:(r + 1) * m] for x in xs])


def call(comm, verb, x, algo, op=None, root=0, out=None, inplace=True):
    if verb == "allreduce":
        return comm.allreduce(x, op=op, algo=algo, out=out, inplace=inplace)
    if verb == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algo=algo, out=out)
    if verb == "allgather":
        return comm.allgather(x, algo=algo, out=out)
    if verb == "broadcast":
        return comm.broadcast(x, root=root, algo=algo)
    return comm.alltoall(x, out=out, algo=algo)


@pytest.fixture
def plans_made(comm, monkeypatch):
    """A list that grows by one key each time a call takes the general path and makes a plan
    (the plans of earlier tests are dropped: every test starts unplanned)."""
    comm._plans.clear()
    made, plan = [], comm._plan

    def counting(key, *a, **k):
        made.append(key)
        return plan(key, *a, **k)
    monkeypatch.setattr(comm, "_plan", counting)
    return made


@pytest.mark.parametrize("verb", VERBS)
def test_planned_calls_match_the_general_path(comm, plans_made, verb):
    # per dtype/algo/op: call 1 takes the general path and makes the plan; calls 2 and 3 run by
    # it (out given, then out=None / out-of-place) and must give bit-identical results
    n, r = comm.size, comm.rank
    for algo in algos_for(comm, verb):
        for i, dt in enumerate(DTYPES):
            for op in (OPS if verb in REDUCTIONS else (None,)):
                root = i % n
                want = expected(verb, n, r, dt, op, root)
                got, before = [], len(plans_made)
                for variant in ("first", "out", "again"):
                    x = operand(verb, r, n, dt)
                    x0 = x.copy()
                    out = np.full(want.shape, 9, x.dtype) if variant == "out" and verb != "broadcast" else None
                    inplace = variant != "again"
                    y = call(comm, verb, x, algo, op, root, out, inplace)
                    what = f"{verb} {algo} {dt} {op} {variant}"
                    if out is not None:
                        assert y is out, what
                    if verb == "broadcast" or (verb == "allreduce" and out is None and inplace):
                        assert y is x, what
                    else:
                        assert y is not x, what
                        np.testing.assert_array_equal(x, x0, err_msg=f"{what}: changed its input")
                    assert y.shape == want.shape and y.dtype == x.dtype, what
                    np.testing.assert_allclose(y.astype(np.float64), want, atol=tol(dt), err_msg=what)
                    got.append(y.copy())
                for y in got[1:]:
                    np.testing.assert_array_equal(y, got[0], err_msg=f"{verb} {algo} {dt} {op}: planned != general")
                # one plan made by the first call; none at size 1 (the verbs copy and return there)
                assert len(plans_made) - before == (1 if n > 1 else 0), (verb, algo, dt, op, plans_made[before:])


def test_a_changed_call_does_not_reuse_a_plan(comm, plans_made):
    n, r = comm.size, comm.rank
    f32, f64 = "float32", "float64"
    # each row: (verb, rows, dtype, algo, op, root): every one differs from the row before it in
    # exactly one part of the key (rows = same size, other shape for reduce_scatter/allgather)
    steps = [("allgather", 4, f32, "mpi", None, 0), ("allgather", 5, f32, "mpi", None, 0),
             ("allgather", 5, f64, "mpi", None, 0), ("allgather", 5, f64, "ring", None, 0),
             ("reduce_scatter", 2 * n, f32, "mpi", "sum", 0), ("reduce_scatter", 2 * n, f32, "mpi", "max", 0),
             ("reduce_scatter", 2 * n + 1, f32, "mpi", "max", 0), ("reduce_scatter", 2 * n + 1, f32, "auto", "max", 0),
             ("broadcast", 3, f32, "mpi", None, 0), ("broadcast", 3, f32, "mpi", None, n - 1),
             ("broadcast", 3, "int64", "mpi", None, n - 1),
             ("alltoall", 2 * n, f32, "mpi", None, 0), ("alltoall", 4 * n, f32, "mpi", None, 0),
             ("alltoall", 4 * n, "bfloat16", "pairwise", None, 0),
             ("allreduce", 4, f32, "mpi", "sum", 0), ("allreduce", 4, f32, "mpi", "avg", 0),
             ("allreduce", 4, "int32", "mpi", "avg", 0)]
    for verb, rows, dt, algo, op, root in steps:
        made = len(plans_made)
        for _ in range(2):
            y = call(comm, verb, operand(verb, r, n, dt, rows), algo, op, root, None, False)
            np.testing.assert_allclose(y.astype(np.float64), expected(verb, n, r, dt, op, root, rows), atol=tol(dt),
                                       err_msg=f"{verb} rows={rows} {dt} {algo} {op} root={root}")
        assert len(plans_made) - made == (1 if n > 1 else 0), (verb, rows, dt, algo, op, root)
    # same size, other shape: the result's shape (and reduce_scatter's rows) follow x's shape
    for verb in ("allreduce", "reduce_scatter", "allgather", "alltoall"):
        for shape in ((2 * n, 3), (n, 6), (6 * n,)):
            xs = [data(k, 6 * n, f32).reshape(shape) for k in range(n)]
            if verb == "allreduce":
                want = reference_reduce(xs, "sum")
            elif verb == "reduce_scatter":
                want = reference_reduce(xs, "sum")[np.array_split(np.arange(shape[0]), n)[r]]
            elif verb == "allgather":
                want = np.concatenate(xs)
            else:
                m = shape[0] // n
                want = np.concatenate([x[r * m:(r + 1) * m] for x in xs])
            for _ in range(2):
                y = call(comm, verb, xs[r].copy(), "mpi", "sum", 0, None, False)
                assert y.shape == want.shape, (verb, shape, y.shape)
                np.testing.assert_allclose(y, want, err_msg=f"{verb} {shape}")


@pytest.mark.parametrize("verb", ("reduce_scatter", "allgather", "alltoall"))
def test_an_out_the_plan_does_not_fit_is_refused(comm, verb):
    # after the plan exists, an out of another shape, dtype or layout (and a strided x) still
    # meet the general path's checks
    n, r = comm.size, comm.rank
    x = operand(verb, r, n, "float32")
    shape = expected(verb, n, r, "float32", "sum", 0).shape
    for _ in range(2):
        call(comm, verb, x, "mpi", "sum", out=np.empty(shape, np.float32))
    bad = {"out has shape": [np.empty((shape[0] + 1,) + shape[1:], np.float32), np.empty(shape, np.float64)],
           "C-contiguous": [np.empty((shape[0], 2 * shape[1]), np.float32)[:, ::2]]}
    for match, outs in bad.items():
        for out in outs:
            with pytest.raises(ValueError, match=match):
                call(comm, verb, x, "mpi", "sum", out=out)
    strided = np.repeat(x, 2, axis=1)[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        call(comm, verb, strided, "mpi", "sum")


@pytest.mark.parametrize("verb", VERBS)
def test_planned_calls_enter_the_arrival_board(comm, verb):
    n, r = comm.size, comm.rank
    x = operand(verb, r, n, "float32")
    for _ in range(2):
        call(comm, verb, x.copy(), "mpi", "sum")
    seq = comm.seq
    call(comm, verb, x.copy(), "mpi", "sum")
    assert comm.seq == seq + 1, "a planned call must count the collective"
    assert comm._board.slots.tolist() == [comm.seq, op_code(verb)], "the board must show this call"


def test_debug_mode_keeps_no_plans(mpi_world, monkeypatch):
    monkeypatch.setattr(settings.SETTINGS, "debug_collectives", True)   # PYMPAR_DEBUG_COLLECTIVES=1
    c = MPIComm(mpi_world, name="debugged", timeout=60)
    n, r = c.size, c.rank
    try:
        for verb in VERBS:
            for _ in range(2):
                y = call(c, verb, operand(verb, r, n, "float32"), "mpi", "sum", 0, None, False)
                np.testing.assert_allclose(y, expected(verb, n, r, "float32", "sum", 0), err_msg=verb)
        assert c._plans == {} and c.seq == 2 * len(VERBS)
    finally:
        c.free()


_ABANDONED = []   # operands of library collectives given up by a timeout: MPI may still write them


@pytest.mark.ranks(lambda n: n > 1)                  # needs a peer
@pytest.mark.parametrize("window", [None, 0.8])
def test_a_hung_peer_times_out_a_planned_call(mpi_world, monkeypatch, window):
    # planned library calls wait with progress.poll1: a rank that never arrives must still end the
    # wait at the deadline with the watchdog's report (op, call number, the missing rank). Rank 1
    # (the broadcast's root: a root need not wait for anyone) joins late, after the others'
    # reports, so the abandoned collective completes and the next verb's calls line up again.
    # window: the C path's yield phase (progress.YIELD_SECONDS) made 0.8 s of the 1 s timeout --
    # the deadline still falls at 1 s from the call's start, not 1 s after the window
    if window is not None:
        monkeypatch.setattr(progress, "YIELD_SECONDS", window)
    n, r = mpi_world.Get_size(), mpi_world.Get_rank()
    # a timeout marks the process so that its exit frees no window (the peers may be gone); here
    # every abandoned call completes, so the flag goes back afterwards and all ranks free alike
    monkeypatch.setattr(watchdog, "_TAINTED", watchdog._TAINTED)
    c = MPIComm(mpi_world, name="hang", timeout=1.0, on_timeout="raise")
    failures = []
    for verb in VERBS:
        x = operand(verb, r, n, "float32")
        for _ in range(2):
            call(c, verb, x.copy(), "mpi", "sum", 1, None, False)   # the second call is planned
        y = x.copy()
        _ABANDONED.append(y)
        if r == 1:
            mpi_world.Barrier()              # inside MPI: answers the board reads
            call(c, verb, y, "mpi", "sum", 1, None, False)
        else:
            t0 = time.monotonic()
            try:
                call(c, verb, y, "mpi", "sum", 1, None, False)
                failures.append(f"{verb}: no CommTimeoutError while rank 1 stayed away")
            except CommTimeoutError as e:
                took = time.monotonic() - t0
                _ABANDONED.append(e)         # its traceback holds the pending request and buffers
                if (e.op, e.comm_name, e.seq, e.pending_peers) != (verb, "hang", c.seq, [1]):
                    failures.append(f"{verb}: wrong report {(e.op, e.comm_name, e.seq, e.pending_peers)}: {e}")
                if f"rank 1 is at #{c.seq - 1} ({verb})" not in str(e):
                    failures.append(f"{verb}: the board's note is missing: {e}")
                if not 0.9 <= took < (10 if window is None else 1.0 + window * 0.75):
                    failures.append(f"{verb}: timed out after {took:.2f}s, timeout 1.0s (yield window {window})")
            mpi_world.Barrier()
        mpi_world.Barrier()                  # every rank here: the next verb starts in step
    c.free()
    assert not failures, failures


# --- the C path of planned library calls (comm/fastcoll.py, csrc/fastcoll.cpp) --------------
C_VERBS = tuple(fastcoll.VERBS)


@pytest.fixture(scope="module")
def aborting(mpi_world):
    c = MPIComm(mpi_world, name="aborting", timeout=60, on_timeout="abort")
    yield c
    c.free()


@pytest.mark.ranks(lambda n: n > 1)
@pytest.mark.parametrize("algo", ("mpi", "blocking"))
@pytest.mark.parametrize("verb", C_VERBS)
def test_planned_library_calls_run_in_c(comm, aborting, monkeypatch, verb, algo):
    # with the native module and the loaded MPI library's functions found (Linux), a planned call
    # of the library's collective -- nonblocking and polled ("mpi"), or blocking under the deadline
    # guard -- runs in C: it never reaches the Python path, counts the call, shows it on the board
    # and gives the general path's bits
    assert fastcoll.library(), "no C path: the MPI library's functions were not found"
    c = aborting if algo == "blocking" else comm
    n, r = c.size, c.rank
    for dt in DTYPES:
        if verb == "allreduce" and backend.dtype(dt).itemsize == 2:
            continue    # 2-byte float reductions run pympar's user op: the Python path
        x = operand(verb, r, n, dt)
        want = expected(verb, n, r, dt, "sum", 0)
        out = None if verb in ("allreduce", "broadcast") else np.empty(want.shape, x.dtype)
        first = call(c, verb, x.copy(), algo, "sum", 0, out).copy()     # the general path makes the plan
        with monkeypatch.context() as m:
            m.setattr(c, "_blocking", lambda *a, **k: pytest.fail(f"{verb} {algo} {dt}: left the C path"))
            for _ in range(3):
                seq, y = c.seq, x.copy()
                got = call(c, verb, y, algo, "sum", 0, out)
                assert got is (y if out is None else out), (verb, algo, dt)
                np.testing.assert_array_equal(got, first, err_msg=f"{verb} {algo} {dt}: C path != general path")
                np.testing.assert_allclose(got.astype(np.float64), want, atol=tol(dt))
                assert c.seq == seq + 1 and c._board.slots.tolist() == [c.seq, op_code(verb)], (verb, algo, dt)
                assert watchdog.SLOT[0] == 0, "the deadline guard must be disarmed after the call"
        # what the plan does not fit goes back to the Python path, which checks as always
        with pytest.raises(ValueError, match="C-contiguous"):
            call(c, verb, np.repeat(x, 2, axis=1)[:, ::2], algo, "sum", 0, out)


@pytest.mark.ranks(lambda n: n > 1)
def test_a_late_peer_is_waited_for_after_the_c_burst(comm, monkeypatch):
    # the C path tests a nonblocking call in a short burst (on this communicator, on_timeout="abort",
    # where its long waits block inside the library, that is all; else it goes on testing between
    # yields, see the next test); a peer that arrives later hands the request to the deadline's
    # Waiter (MPIComm._c_finish), which finishes it
    n, r = comm.size, comm.rank
    handed = []
    finish = comm._c_finish
    monkeypatch.setattr(comm, "_c_finish", lambda res, verb, dst: handed.append(res[0]) or finish(res, verb, dst))
    comm.allreduce(np.ones(7, np.float32), algo="mpi")                # the plan
    kind = 1 if progress.blocks(comm._abort_token) else 2             # (2: ranks outnumber cores)
    for late in range(n):
        x = np.full(7, r + 1.0, np.float32)
        before = len(handed)
        if r == late:
            time.sleep(0.2)
        assert comm.allreduce(x, algo="mpi") is x
        np.testing.assert_array_equal(x, n * (n + 1) / 2)
        if r != late:       # waited 0.2 s for the late rank: past the burst, handed over pending
            assert handed[before:] == [kind], (late, handed)


@pytest.mark.ranks(lambda n: n > 1)
@pytest.mark.parametrize("window, handed_as", [(2.0, []), (0.05, [2]), (0.0, [1])])
def test_the_c_path_yield_phase_waits_without_python(mpi_world, monkeypatch, window, handed_as):
    # on_timeout="raise": a wait never blocks in the library, so after its burst of tests the C path
    # tests between sched_yield calls for progress.YIELD_SECONDS (read when the plan is made): a peer
    # 0.2 s late inside that window is waited for in C (nothing handed to Python); past it the
    # request goes to the Waiter as (2, request), whose deadline counts the window; no window: (1, ...)
    monkeypatch.setattr(progress, "YIELD_SECONDS", window)
    c = MPIComm(mpi_world, name=f"fastpath-raise-{window}", timeout=60, on_timeout="raise")
    handed = []
    finish = c._c_finish
    monkeypatch.setattr(c, "_c_finish", lambda res, verb, dst: handed.append(res[0]) or finish(res, verb, dst))
    c.allreduce(np.ones(7, np.float32), algo="mpi")                   # the plan
    n, r = c.size, c.rank
    x = np.full(7, r + 1.0, np.float32)
    before = len(handed)
    if r == 0:
        time.sleep(0.2)
    assert c.allreduce(x, algo="mpi") is x
    np.testing.assert_array_equal(x, n * (n + 1) / 2)
    if r != 0:
        assert handed[before:] == handed_as, (window, handed)
    c.free()


def test_freeing_a_communicator_drops_its_c_plans(mpi_world):
    c = MPIComm(mpi_world, name="freed", timeout=60)
    for _ in range(2):
        c.allreduce(np.ones(3), algo="mpi")
    if c.size > 1:
        assert c._fast_allreduce is not None
    c.free()    # the board's memory goes: nothing may keep its address
    assert c._fast_allreduce is None and all(p.native is None for p in c._plans.values())
