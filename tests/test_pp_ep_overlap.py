"""DualPipeV's F & B pairs interleaved at the expert-parallel all-to-alls, under mpiexec: the
exchanges start inside live pairs and training is bitwise the sequential run of the same table
(tests/mpi/mpi_pp_ep_overlap.py). CI runs dp2 x pp2 x ep2; 8 ranks (ep 2 and 4) are @slow."""
import pytest

from mpirun import run_pytest_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_dualpipev_pairs_overlap_the_ep_all_to_alls(n):
    run_pytest_mpi(n, "mpi_pp_ep_overlap.py", timeout=150 if n == 4 else 400)


def test_auto_overlaps_across_nodes_only():
    """On one node (the first test's run) --pp-overlap auto leaves the pairs sequential; with every
    rank a node of its own it interleaves them, and the node-aware route's hops are interleaved
    bitwise too."""
    run_pytest_mpi(4, "mpi_pp_ep_overlap.py", timeout=150, env={"PYMPAR_RANKS_PER_NODE": "1"},
                   extra_args=("-k", "auto or node_aware"))


@pytest.mark.slow
def test_node_aware_hops_overlap_on_two_nodes():
    """8 ranks, two a node: ep 4 spans 2 nodes of 2, so both hops run inside the pairs."""
    run_pytest_mpi(8, "mpi_pp_ep_overlap.py", timeout=400, env={"PYMPAR_RANKS_PER_NODE": "2"},
                   extra_args=("-k", "node_aware"))
