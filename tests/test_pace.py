"""The polling pace counts the cores a node's ranks may use together, not one process's mask: ranks
a launcher binds to a core each (hydra's -bind-to core, Open MPI's --bind-to core, pympar's --bind
cores) each see one core, yet no two share one -- they are not oversubscribed, so their collective
waits may block inside MPI (comm/progress.py)."""
import os

import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = """
import os, sys
from mpi4py import MPI
cores = sorted(os.sched_getaffinity(0))
w = MPI.COMM_WORLD
os.sched_setaffinity(0, {cores[w.Get_rank() % int(sys.argv[1])]})   # each rank bound to one core
from pympar.comm import MPIComm, progress
c = MPIComm(w)
c.topology()
print(f"rank {w.Get_rank()}: oversubscribed={progress.oversubscribed()} host_cores={c.topology().host_cores}", flush=True)
"""


@pytest.mark.parametrize("bound_to,want", [(2, False), (1, True)])
def test_ranks_bound_to_a_core_each_are_not_oversubscribed(bound_to, want):
    """2 ranks bound to 2 different cores: not oversubscribed (before: each saw 1 core for 2 ranks).
    2 ranks bound to the same core: oversubscribed."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    res = run_mpi(2, ["-c", SCRIPT, str(bound_to)], timeout=60)
    for r in range(2):
        assert f"rank {r}: oversubscribed={want} host_cores={bound_to}" in res.stdout, res.stdout
