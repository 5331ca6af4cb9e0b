"""pympar.parallel.cores: a program of its own under mpiexec (not pympar.train) gives each rank
its share of the node's cores -- kernel and BLAS threads -- with no thread variable set, and a
variable the application read wins."""
import os

import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.timeout(180)

NO_THREAD_VARS = {k: None for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PYMPAR_NUM_THREADS")}

PROGRAM = r"""
from mpi4py import MPI
from pympar import kernels
from pympar.comm import MPIComm
from pympar.config import apply_environment
from pympar.kernels import blas
from pympar.parallel.cores import share_cores

env = apply_environment()
comm = MPIComm(MPI.COMM_WORLD)
before = blas.blas_threads()
n, why = share_cores(comm, env.threads, env.threads_from)
line = (f"rank {comm.rank}: n={n} kernels={kernels.get_num_threads()} blas_before={before} "
        f"blas={blas.blas_threads()} why={why}")
lines = MPI.COMM_WORLD.gather(line, root=0)      # one writer: ranks' lines never interleave
if comm.rank == 0:
    print("\n".join(lines), flush=True)
comm.free()
"""


def _rows(out, n):
    import re

    rows = [re.search(r"rank (\d+): n=(\d+) kernels=(\d+) blas_before=(\w+) blas=(\w+) why=(.*)$", ln)
            for ln in out.splitlines() if ln.startswith("rank ")]
    assert len(rows) == n and all(rows), out[-3000:]
    return [(int(r[2]), int(r[3]), r[4], r[5], r[6]) for r in rows]


def test_ranks_of_a_plain_mpiexec_program_share_the_cores():
    cores = len(os.sched_getaffinity(0))
    want = max(1, cores // 4)
    res = run_mpi(4, ["-c", PROGRAM], timeout=120, env=NO_THREAD_VARS)
    for n, k, before, after, why in _rows(res.stdout, 4):
        assert n == k == want and f"{cores} cores / 4 ranks on this node" in why, why
        if after != "None":                         # an OpenBLAS in the process: it follows
            assert int(after) == want, (before, after)
        assert ("oversubscribed" in why) == (4 * want > cores), why


def test_a_thread_variable_wins_over_the_share():
    res = run_mpi(2, ["-c", PROGRAM], timeout=120, env=dict(NO_THREAD_VARS, PYMPAR_NUM_THREADS=3))
    for n, k, _, after, why in _rows(res.stdout, 2):
        assert n == k == 3 and why.startswith("PYMPAR_NUM_THREADS"), why
        assert after in ("None", "3"), after
