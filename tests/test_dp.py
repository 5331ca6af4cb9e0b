"""Data parallelism under mpiexec: DataParallel (buckets, overlap, accumulation, ZeRO-1) and
gradient compression against the single-process run (tests/mpi/mpi_dp*.py).
CI runs dp=2 and 4 (compression at 2); the other sizes are @slow."""
import pytest

from mpirun import run_pytest_mpi

pytestmark = pytest.mark.mpi
slow = pytest.mark.slow


@pytest.mark.parametrize("n", [2, 4, pytest.param(1, marks=slow), pytest.param(3, marks=slow)])
def test_dp_matches_single_process(n):
    run_pytest_mpi(n, "mpi_dp.py", timeout=120)


@pytest.mark.parametrize("n", [2, pytest.param(1, marks=slow), pytest.param(4, marks=slow)])
def test_dp_compression(n):
    run_pytest_mpi(n, "mpi_dp_compress.py", timeout=120)
