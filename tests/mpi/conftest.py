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
