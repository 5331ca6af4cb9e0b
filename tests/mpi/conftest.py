"""Fixtures for tests that run inside every rank of an mpiexec job, and one agreement per test:
a test that fails (or errors in setup) on some ranks fails on every rank, naming them, so that
with -x all ranks stop together instead of the others entering the next test's collectives alone
and waiting there for a rank that has left (a hang until the job's timeout).

Each rank's test process is an application: it reads the environment the test harness set
(PYMPAR_TUNING, PYMPAR_DEBUG_COLLECTIVES, PYMPAR_RANKS_PER_NODE, ...) once, at its edge."""
import pytest

import pympar.config

pympar.config.apply_environment()

_agree = None


def _comm():
    global _agree
    if _agree is None:
        from mpi4py import MPI
        _agree = MPI.COMM_WORLD.Dup()   # its own communicator: never matched with a test's collectives
    return _agree


def pytest_configure(config):
    config.addinivalue_line("markers", "ranks(fits): the test runs where fits(world size) is true; at other "
                                       "world sizes it is deselected (never collected as a skip)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``ranks(fits)`` that do not fit this job's world size are deselected, the same
    on every rank: a skip is kept for what the machine lacks, not for the test's own set-up."""
    from mpi4py import MPI

    n = MPI.COMM_WORLD.Get_size()
    keep, drop = [], []
    for item in items:
        m = item.get_closest_marker("ranks")
        (keep if m is None or m.args[0](n) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def mpi_world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    # exactly one agreement per test and rank: in setup when setup did not pass (no call phase
    # follows), else in call
    if not (call.when == "call" or (call.when == "setup" and not rep.passed)):
        return
    comm = _comm()
    failed = [r for r, f in enumerate(comm.allgather(bool(rep.failed))) if f]
    if failed and not rep.failed:
        rep.outcome = "failed"
        rep.longrepr = f"{item.nodeid} failed on rank(s) {failed} of {comm.size} (see their reports)"
