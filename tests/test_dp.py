"""Data parallelism under mpiexec: DataParallel (buckets, overlap, accumulation, ZeRO-1) and
gradient compression against the single-process run (tests/mpi/mpi_dp*.py)."""
import pytest

from mpirun import run_pytest_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 4])
def test_dp_matches_single_process(n):
    run_pytest_mpi(n, "mpi_dp.py", timeout=90)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3])
def test_dp_matches_single_process_other_sizes(n):
    run_pytest_mpi(n, "mpi_dp.py", timeout=120)


@pytest.mark.parametrize("n", [2])
def test_dp_compression(n):
    run_pytest_mpi(n, "mpi_dp_compress.py", timeout=90)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 4])
def test_dp_compression_other_sizes(n):
    run_pytest_mpi(n, "mpi_dp_compress.py", timeout=120)
