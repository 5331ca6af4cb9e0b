"""Launch the communicator tests under mpiexec -n 1, 2, 3, 4 (8 and the full matrix: slow)."""
import pytest

from mpirun import run_pytest_mpi

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


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_comm_fast_paths(n):
    # chunked shm allreduce at chunk boundaries, every dtype/op; the cached plans of the five
    # blocking verbs against the general path, and a hung peer timing a planned call out
    run_pytest_mpi(n, "mpi_comm_fastpath.py", timeout=150)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_auto_tuning_files_and_agreed_measurement(n):
    run_pytest_mpi(n, "mpi_tuning.py", timeout=120)


def test_collectives_on_the_network_transport():
    # MPICH's netmod for every message (what ranks on different nodes use): each rank is its own node
    run_pytest_mpi(4, "mpi_comm.py", timeout=180, env={"MPIR_CVAR_NOLOCAL": 1})


def test_collectives_on_two_real_nodes():
    # MPICH cliques: ranks {0, 2} and {1, 3} share memory, messages between them take the netmod --
    # hierarchical's inter-node leg on the network transport, its nodes not contiguous in rank order
    run_pytest_mpi(4, "mpi_comm.py", timeout=180, env={"MPIR_CVAR_NUM_CLIQUES": 2})
    run_pytest_mpi(4, "mpi_tuning.py", timeout=120, env={"MPIR_CVAR_NUM_CLIQUES": 2})


def test_importing_pympar_comm_does_not_start_mpi():
    """docs/design.md: `import pympar.comm` does not initialise MPI (importing mpi4py.MPI would): the
    base, SelfComm, requests and datatypes take mpi4py on first use; the model and parallel
    layers import without it too, and SelfComm works with no MPI at all."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "import pympar.comm, pympar.nn, pympar.parallel.runner, pympar.parallel.mesh\n"
            "from pympar.comm import SelfComm\n"
            "c = SelfComm(); x = np.ones(4, np.float32); c.allreduce(x)\n"
            "y = np.empty_like(x); r = c.isend(x, 0); c.irecv(y, 0).wait(); r.wait()\n"
            "assert (y == 1).all()\n"
            "print(sorted(m for m in sys.modules if m.startswith('mpi4py')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
