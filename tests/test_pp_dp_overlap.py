"""Data-parallel gradient buckets overlapped with pipeline backward (dp x pp) under mpiexec:
buckets start once their gradients are final, before finish(), with the numbers of the
non-overlapped sync (tests/mpi/mpi_pp_dp_overlap.py). CI runs dp2 x pp2; dp4 x pp2 and
dp2 x pp2 x tp2 (sequence parallel) at 8 ranks are @slow."""
import pytest

from mpirun import run_pytest_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_dp_buckets_overlap_pipeline_backward(n):
    run_pytest_mpi(n, "mpi_pp_dp_overlap.py", timeout=120 if n == 4 else 300)
