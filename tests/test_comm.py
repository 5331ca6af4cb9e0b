"""Launch the communicator tests under mpiexec -n 1, 2, 3, 4 (8 and the full matrix: slow)."""
import re

import pytest

from mpirun import run_mpi, run_pytest_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_comm_verbs_and_algorithms(n):
    run_pytest_mpi(n, "mpi_comm.py", timeout=150)


def test_hierarchical_on_simulated_nodes():
    # 5 ranks as nodes of 2, 2, 1: uneven nodes, a leader ring of 3
    run_pytest_mpi(5, "mpi_comm.py", timeout=180, env={"PYMPAR_RANKS_PER_NODE": 2},
                   extra_args=["-k", "allreduce or reduce_scatter or allgather or permuted or broadcast"])


@pytest.mark.slow
@pytest.mark.parametrize("n", [5, 6, 7, 8])
def test_comm_full_matrix(n):
    run_pytest_mpi(n, "mpi_comm.py", timeout=600, env={"PYMPAR_TEST_FULL": 1})


@pytest.mark.slow
def test_hierarchical_8_ranks_4_nodes():
    run_pytest_mpi(8, "mpi_comm.py", timeout=600, env={"PYMPAR_RANKS_PER_NODE": 2, "PYMPAR_TEST_FULL": 1})


@pytest.mark.parametrize("algo,n", [("shm", 3), ("ring", 3), ("mpi", 2)])
def test_skipped_collective_times_out_naming_the_rank(algo, n):
    p = run_mpi(n, ["tests/mpi/mpi_comm_timeout.py", algo], timeout=60)
    # ranks print concurrently: lines may interleave, so match records, not lines
    recs = re.findall(r"rank (\d+): TIMEOUT op=(\S+) comm=(\S+) seq=(\d+) peers=\[([\d, ]*)\] after=([\d.]+)s", p.stdout)
    assert sorted(int(r[0]) for r in recs) == [k for k in range(n) if k != 1], p.stdout
    assert "NO-ERROR" not in p.stdout, p.stdout
    peers = set()
    for rank, op, comm, seq, pr, after in recs:
        assert (op, comm, seq) == ("allreduce", "watched", "2"), p.stdout
        assert 1.4 <= float(after) < 15, p.stdout
        peers |= set(map(int, re.findall(r"\d+", pr)))
    if algo != "mpi":   # inside the library's collective only the watchdog board can tell
        assert 1 in peers, p.stdout
