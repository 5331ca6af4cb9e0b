"""algo="auto": agreed measurement, tuning files (fitting, of another shape or machine), library mode."""
import json
import os
import tempfile
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from pympar.comm import MPIComm
from pympar.comm import mpi as mpi_module
from pympar.comm import settings, tuning, watchdog


@pytest.fixture()
def fresh(mpi_world, monkeypatch):
    """A new MPIComm per test (no decisions yet); the tuning setting as the test sets it."""
    made = []
    tuning._SHARED.clear()      # no decisions from earlier tests' communicators of the same ranks

    def make(setting=None):
        # what PYMPAR_TUNING would set at an application's edge (pympar.config.apply_environment)
        monkeypatch.setattr(settings.SETTINGS, "tuning", "" if setting is None else str(setting))
        c = MPIComm(mpi_world, name="tuned", timeout=60)
        made.append(c)
        return c

    yield make
    for c in made:
        c.free()


def agreed(comm, value):
    return comm.mpi_comm.allgather(value)


@pytest.mark.ranks(lambda n: n > 1)          # size 1: auto is the only call there is
def test_decision_is_the_same_on_every_rank_when_their_timings_disagree(fresh):
    c = fresh()
    names = c.candidates("allreduce")
    k, n, r = len(names), c.size, c.rank

    # rank r's own clock says candidate (r % k) is fastest, by a wide margin
    def fake(rank, j):
        return 1e-3 * (1 + ((j - rank) % k)) + 1e-6 * j

    c._timer = lambda name, run: (run(), fake(r, names.index(name)))[1]
    d = c.explain("allreduce", 4096)
    own_best = min(names, key=lambda a: fake(r, names.index(a)))
    calls = tuning.batch(4096)             # a round's time is divided by its calls
    slowest = {a: max(fake(q, j) for q in range(n)) / calls for j, a in enumerate(names)}
    close = tuning.contenders(slowest)     # timed again in longer rounds (the fake round time is fixed)
    if len(close) > 1:
        again = tuning.again(min(slowest.values()), calls)
        slowest.update({a: slowest[a] * calls / again for a in close})
    assert d.source == "measured"
    assert agreed(c, d.algo) == [d.algo] * n, "ranks decided differently"
    assert d.algo == tuning.pick(slowest)
    assert d.times_us == pytest.approx({a: t * 1e6 for a, t in slowest.items()})
    assert len(set(agreed(c, own_best))) > 1      # the ranks' own timings did disagree
    # the decision is kept: a real call of that bucket runs it and is correct
    x = np.full(1000, float(r + 1), np.float32)
    c.allreduce(x)
    assert np.all(x == n * (n + 1) / 2)
    assert c.explain("allreduce", 3000) is d            # same bucket (2049..4096 B), no new measurement
    # another communicator of the same ranks shares the decisions: no measurement (its timer would
    # make each rank pick its own favourite if it ran), the same Decision object
    c2 = fresh()
    c2._timer = lambda name, run: (run(), fake(-r, names.index(name)))[1]
    assert c2.explain("allreduce", 4096) is d
    # ... and a communicator of other ranks (here: reversed order) measures for itself
    rev = MPIComm(c.mpi_comm.Split(0, n - 1 - r), name="reversed", timeout=60)
    assert rev.explain("allreduce", 4096).source == "measured"
    rev.free()


@pytest.mark.ranks(lambda n: n > 1)          # size 1: auto is the only call there is
def test_real_calls_measure_each_bucket_once_and_stay_correct(fresh):
    c = fresh()
    calls = []
    c._timer = lambda name, run: (calls.append(name), tuning._time_it(name, run))[1]
    n, r = c.size, c.rank
    measured = []
    for _ in range(2):                   # the second pass meets only buckets already decided
        for count in (1, 3, 1000, 1000, 50_000):
            x = np.full(count, float(r + 1))
            y = c.allreduce(x, inplace=False)
            assert np.all(y == n * (n + 1) / 2) and np.all(x == r + 1)   # the measurement left x alone
            g = c.allgather(np.full(count, r, np.int64))
            assert g.tolist() == sum(([q] * count for q in range(n)), [])
            b = np.full(count, 7.0) if r == 0 else np.zeros(count)
            assert np.all(c.broadcast(b, root=0) == 7.0)
        measured.append(len(calls))
    # buckets: 8 B, 24 B -> 32, 8000 -> 8192 (twice: measured once), 400000 -> 2^19; three verbs;
    # each candidate timed rounds(nbytes) times, the contenders of a bucket as many times again
    per_bucket = {"allreduce": len(c.candidates("allreduce")), "allgather": len(c.candidates("allgather")),
                  "broadcast": len(c.candidates("broadcast"))}
    rounds = sum(per_bucket[v] * tuning.rounds(nb) for v in per_bucket
                 for nb in ({"allgather": [8 * n, 24 * n, 8000 * n, 400_000 * n]}.get(v, [8, 24, 8000, 400_000])))
    assert rounds <= measured[0] <= 2 * rounds
    assert measured[1] == measured[0]
    assert len({(d.collective, d.bucket) for d in c._tuner.decisions.values()}) == 12


@pytest.mark.ranks(lambda n: n > 1)          # size 1: auto is the only call there is
@pytest.mark.parametrize("mode", ["raise", "abort"])
def test_a_measurement_longer_than_the_timeout_is_not_a_timeout(mpi_world, monkeypatch, mode):
    # the timeout bounds each round of auto's measurement and then the call itself, not the
    # measurement as a whole. Rank 0 takes 50 ms more per round, which the others wait for at the
    # next round's barrier (polled, or -- abort mode with a core per rank -- blocked in the library
    # under the deadline guard), so the measurement lasts several timeouts; then every rank pauses
    # for a timeout and rank 0 for 0.1 s more, which the others wait for in the call itself. A
    # timeout here ends the job in abort mode (the test then fails with the watchdog's report).
    monkeypatch.setattr(settings.SETTINGS, "tuning", "")
    tuning._SHARED.clear()
    c = MPIComm(mpi_world, name="short", timeout=0.4, on_timeout=mode)
    real = mpi_module.measure

    def measure_then_pause(*args, **kw):
        out = real(*args, **kw)
        time.sleep(c.timeout + 0.1 * (c.rank == 0))
        return out
    monkeypatch.setattr(mpi_module, "measure", measure_then_pause)
    try:
        def slow_rank0(name, run):
            t = tuning._time_it(name, run)
            if c.rank == 0:
                time.sleep(0.05)
            return t
        c._timer = slow_rank0
        x = np.full(1000, float(c.rank + 1))
        t0 = time.monotonic()
        c.allreduce(x, algo="auto")
        assert time.monotonic() - t0 > 3 * c.timeout          # the measurement outlasted the timeout
        assert np.all(x == c.size * (c.size + 1) / 2)          # and the call completed
        assert c.explain("allreduce", x.nbytes).source == "measured"
    finally:
        c.free()


@pytest.mark.ranks(lambda n: n > 1)
def test_a_renewed_waiter_is_a_new_wait_for_the_deadline_guard(mpi_world, monkeypatch):
    # one operation's Waiter serving several waits, as auto's measurement holds it: each wait after
    # renew() has its own timeout, also where a wait blocks inside the library and the deadline
    # guard keeps its clock (abort mode, a core per rank, once the first call told the pace so):
    # the guard sees the slot armed with the same call number for all 16 waits, 0.1 s each, and
    # the generation tells them apart, so it never starts to expire one (without the generation it
    # did, 0.4 s in, and only its second look -- the wait over by then -- kept the job alive)
    guard = watchdog.deadline_guard()
    expired = []
    real = guard._expire
    monkeypatch.setattr(guard, "_expire", lambda comm, call: (expired.append(call), real(comm, call)))
    c = MPIComm(mpi_world, name="renewed", timeout=0.4, on_timeout="abort")
    try:
        c.allreduce(np.zeros(1))
        w = c._deadline("allreduce", c.seq)
        t0 = time.monotonic()
        for _ in range(16):
            if c.rank == 0:
                time.sleep(0.1)
            w.renew()
            w.wait([c._coll.Ibarrier()], [None])
        assert time.monotonic() - t0 > 2 * c.timeout
        assert expired == [], f"rank {c.rank}: the deadline guard took renewed waits for one: {expired}"
    finally:
        c.free()


def _model(per_call, skew):
    """Candidates whose rounds take skew + calls x per_call[name] seconds (a model of how far
    apart a barrier lets the ranks go, paid once a round), and the log of (name, calls) per round."""
    calls = dict.fromkeys(per_call, 0)
    runs = {a: (lambda a=a: calls.__setitem__(a, calls[a] + 1)) for a in per_call}
    log = []

    def timer(name, run):
        before = calls[name]
        run()
        log.append((name, calls[name] - before))
        return skew + log[-1][1] * per_call[name]
    return runs, timer, log


def test_contenders_are_timed_again_in_longer_rounds(mpi_world):
    # small message: in bursts of batch() calls the fixed 0.5 ms hides a's lead over b (within the
    # library's 5% margin), in rounds of again() calls it shows; c is not a contender
    per_call = {"a": 10e-6, "b": 13e-6, "c": 60e-6}
    runs, timer, log = _model(per_call, 5e-4)
    k, reps = tuning.batch(64), tuning.rounds(64)
    first = {a: (5e-4 + k * s) / k for a, s in per_call.items()}
    assert tuning.contenders(first) == ["a", "b"]
    assert tuning.pick(first, library="b") == "b"
    k2 = tuning.again(first["a"], k)
    assert k < k2 <= 256
    times = tuning.measure(list(per_call), runs, mpi_world, 64, timer)
    assert sorted(set(log)) == [("a", k), ("a", k2), ("b", k), ("b", k2), ("c", k)]
    assert [log.count(e) for e in [("a", k), ("a", k2), ("b", k2), ("c", k)]] == [reps] * 4
    assert times == pytest.approx({"a": (5e-4 + k2 * 10e-6) / k2, "b": (5e-4 + k2 * 13e-6) / k2, "c": first["c"]})
    assert tuning.pick(times, library="b") == "a"
    # large message: one call a round already; the contenders get as many rounds again, and the
    # median is over all of them
    big = 4 << 20
    k, reps = tuning.batch(big), tuning.rounds(big)
    assert k == 1 and tuning.again(5e-3, k) == 1
    per_call = {"a": 5e-3, "b": 6e-3, "c": 20e-3}
    runs, timer, log = _model(per_call, 0.0)
    tuning.measure(list(per_call), runs, mpi_world, big, timer)
    assert [log.count((a, 1)) for a in per_call] == [2 * reps, 2 * reps, reps]
    # ... and the median is over all of them: a's first rounds take 9 ms, its second ones 5-6
    assert reps == 3
    rounds = {"a": iter([9e-3] * 3 + [5e-3, 5e-3, 6e-3]), "b": iter([8e-3] * 6)}
    times = tuning.measure(["a", "b"], {a: (lambda: None) for a in rounds}, mpi_world, big,
                           lambda name, run: (run(), next(rounds[name]))[1])
    assert times == pytest.approx({"a": 7.5e-3, "b": 8e-3})     # a: median of 5, 5, 6, 9, 9, 9


def _write(path, shape, algo_4k, machine=None):
    data = {"format": tuning.FORMAT, "machine": machine or tuning.machine(),
            "shapes": {shape: {"allreduce": {"float32": {"12": {"nbytes": 4096, "algo": algo_4k, "times_us": {}}}}}}}
    with open(path, "w") as f:
        json.dump(data, f)


def _shared_path(comm, name):
    """A path every rank sees (rank 0's temporary directory; the ranks share this machine)."""
    d = comm.mpi_comm.bcast(tempfile.mkdtemp(prefix="pympar-tune-") if comm.rank == 0 else None, 0)
    return os.path.join(d, f"{name}.json")


@pytest.mark.ranks(lambda n: n > 1)          # size 1: auto is the only call there is
def test_tuning_file_of_this_shape_is_used(fresh, mpi_world, tmp_path):
    probe = fresh()
    path = _shared_path(probe, "tune_fit")
    want = "ring"
    if probe.rank == 0:
        _write(path, probe.shape_key(), want)
    else:
        probe.shape_key()
    mpi_world.Barrier()
    c = fresh(path)
    d = c.explain("allreduce", 4096)
    assert (d.algo, d.source) == (want, "file")
    x = np.full(1024, float(c.rank), np.float32)
    c.allreduce(x)
    assert np.all(x == c.size * (c.size - 1) / 2)
    assert c.explain("allreduce", 64).source == "measured"     # a bucket the file lacks
    mpi_world.Barrier()
    if c.rank == 0:
        os.remove(path)


@pytest.mark.ranks(lambda n: n > 1)          # size 1: no decisions
@pytest.mark.parametrize("what", ["shape", "machine"])
def test_tuning_file_of_another_shape_or_machine_is_ignored_with_a_warning(fresh, mpi_world, what):
    probe = fresh()
    path = _shared_path(probe, f"tune_{what}")
    shape = probe.shape_key()
    if probe.rank == 0:
        if what == "shape":
            _write(path, f"{probe.size + 3}r-1n-{probe.size + 3}rpn", "ring")
        else:
            _write(path, shape, "ring", machine={"cpu": "another CPU", "mpi": "another MPI 1.0"})
    mpi_world.Barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        c = fresh(path)
        d = c.explain("allreduce", 4096)
    msgs = [str(w.message) for w in seen if issubclass(w.category, tuning.TuningWarning)]
    if c.rank == 0:
        assert msgs and ("no entries" in msgs[0] if what == "shape" else "another CPU" in msgs[0]), msgs
        assert "measuring instead" in msgs[0]
    else:
        assert not msgs        # one warning per communicator, from its rank 0
    assert d.source == "measured"
    mpi_world.Barrier()
    if c.rank == 0:
        os.remove(path)


def test_library_mode_and_a_file_that_is_not_a_tuning_file(fresh, mpi_world):
    c = fresh("library")
    d = c.explain("allgather", 1 << 20)
    assert d.algo == "mpi" and d.source in ("library", "only")
    path = _shared_path(c, "not_tuning")
    if c.rank == 0:
        with open(path, "w") as f:
            json.dump({"allreduce": {"single_node": [[8192, "mpi"]]}}, f)   # the old table format
    mpi_world.Barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        c2 = fresh(path)
    if c2.rank == 0:
        assert any("is not a pympar-tuning/2 tuning file" in str(w.message) for w in seen)
    assert c2.explain("allreduce", 100).source in ("measured", "only")
    mpi_world.Barrier()
    if c2.rank == 0:
        os.remove(path)


def test_write_file_then_read_back(tmp_path):
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    p = tmp_path / "t.json"
    tuning.write_file(p, "2r-1n-2rpn", "allreduce", "float32", {4096: {"mpi": 5e-6, "ring": 4.9e-6},
                                                               1 << 20: {"mpi": 2e-4, "shm": 1e-4}})
    tuning.write_file(p, "4r-1n-4rpn", "allreduce", "float32", {4096: {"mpi": 5e-6, "ring": 1e-6}})
    data = tuning.read_setting(str(p))
    t = data["shapes"]["2r-1n-2rpn"]["allreduce"]["float32"]
    assert t["12"]["algo"] == "mpi"          # within MARGIN of the library: the library
    assert t["20"]["algo"] == "shm"
    assert data["shapes"]["4r-1n-4rpn"]["allreduce"]["float32"]["12"]["algo"] == "ring"


@pytest.mark.parametrize("damage", ["machine not an object", "shapes a list", "a shape a list",
                                    "a verb a list", "an entry without algo", "times not numbers", "deep nesting",
                                    "a pipe"])
def test_a_damaged_tuning_file_is_a_warning_and_a_measurement_not_a_crash(tmp_path, damage):
    """read_setting (PYMPAR_TUNING) on a file of the right format with the wrong tree, nested past
    the parser's depth, or a named pipe (never opened: it would block): a TuningWarning and None."""
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    p = tmp_path / "t.json"
    tuning.write_file(p, "2r-1n-2rpn", "allreduce", "float32", {4096: {"mpi": 5e-6, "ring": 4.9e-6}})
    data = json.loads(p.read_text())
    table = data["shapes"]["2r-1n-2rpn"]
    if damage == "a pipe":
        p.unlink()
        os.mkfifo(p)
    elif damage == "deep nesting":
        p.write_text('{"format": "pympar-tuning/2", "shapes": ' + "[" * 100000 + "]" * 100000 + "}")
    else:
        if damage == "machine not an object":
            data["machine"] = "x"
        elif damage == "shapes a list":
            data["shapes"] = ["2r-1n-2rpn"]
        elif damage == "a shape a list":
            data["shapes"]["2r-1n-2rpn"] = [1]
        elif damage == "a verb a list":
            table["allreduce"] = [1]
        elif damage == "an entry without algo":
            del table["allreduce"]["float32"]["12"]["algo"]
        else:
            table["allreduce"]["float32"]["12"]["times_us"] = {"mpi": "fast"}
        p.write_text(json.dumps(data))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert tuning.read_setting(str(p)) is None
    assert any(issubclass(w.category, tuning.TuningWarning) for w in seen), [str(w.message) for w in seen]


def test_blocking_library_call_needs_abort_mode_and_is_a_choice_there(mpi_world):
    raising = MPIComm(mpi_world, name="raising", timeout=60, on_timeout="raise")
    assert "blocking" not in raising.candidates("allreduce")
    with pytest.raises(ValueError, match="on_timeout='abort'"):
        raising.allreduce(np.ones(3), algo="blocking")
    c = MPIComm(mpi_world, name="aborting", timeout=60, on_timeout="abort")
    n, r = c.size, c.rank
    if n > 1:
        assert c.candidates("allgather")[:2] == ["mpi", "blocking"]
    for dt in (np.float32, np.float64, np.int64, np.float16):
        for _ in range(2):                                   # general path, then the plan's fast path
            x = np.arange(2 * n + 1).astype(dt) + r
            want = (np.arange(2 * n + 1) * n + n * (n - 1) // 2).astype(np.float64)
            got = c.allreduce(x, algo="blocking", inplace=False)
            np.testing.assert_allclose(got.astype(np.float64), want)
            c.allreduce(x, op="avg", algo="blocking")        # in place, avg
            avg = want // n if np.issubdtype(dt, np.integer) else want / n    # integers: floor division
            # exact: the sum of small integers is exact in every dtype here, and sum / n is k + (n - 1) / 2,
            # an integer or a half-integer, which float16 holds exactly at these sizes
            np.testing.assert_array_equal(x.astype(np.float64), avg)
            rs = c.reduce_scatter(np.ones((n + 1, 2), dt), algo="blocking")
            assert rs.shape[0] == len(np.array_split(np.arange(n + 1), n)[r]) and np.all(rs == n)
            g = c.allgather(np.full(2, r, dt), algo="blocking")
            assert g.astype(int).tolist() == sum(([q, q] for q in range(n)), [])
            b = np.full(3, 5, dt) if r == 0 else np.zeros(3, dt)
            assert np.all(c.broadcast(b, algo="blocking") == 5)
            a = c.alltoall(np.full(n, r, dt), algo="blocking")
            assert a.astype(int).tolist() == list(range(n))
    raising.free()
    c.free()


@pytest.mark.ranks(lambda n: n > 1)          # size 1: auto is the only call there is
def test_reproducible_mode_measures_only_what_cannot_change_the_bits(fresh):
    c = fresh("reproducible")
    names = c.candidates("allreduce")
    timed = []
    other = names[-1]                        # a pympar algorithm, made to look 10x faster than the rest

    def timer(name, run):
        timed.append(name)
        run()
        return 1e-4 if name == other else 1e-3
    c._timer = timer
    d = c.explain("allreduce", 4096, "float32")
    if c.size >= 3:                           # the ranks' terms in another order: not measured
        lib = "blocking" if c.on_timeout == "abort" else "mpi"     # the library's call, blocking where allowed
        assert (d.source, d.algo, timed) == ("reproducible", lib, [])
        assert c.explain("reduce_scatter", 1 << 16, "float64").source == "reproducible"
    else:                                     # a + b whatever the algorithm
        assert (d.source, d.algo) == ("measured", other) and timed
    timed.clear()
    i = c.explain("allreduce", 4096, "int64")        # integer sums are exact in any order
    assert (i.source, i.algo) == ("measured", other) and timed
    g = c.explain("allgather", 1 << 12, "float32")
    assert g.source in ("measured", "only")
    x = np.full(1001, float(c.rank + 1), np.float32)
    c.allreduce(x)
    assert np.all(x == c.size * (c.size + 1) / 2)
