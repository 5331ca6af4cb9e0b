"""run_pytest_mpi fails when a rank's tests all skipped (it would otherwise pass having tested nothing)."""
import pytest

from mpirun import run_pytest_mpi

pytestmark = pytest.mark.mpi


def test_all_skipped_fails_with_the_reason():
    with pytest.raises(AssertionError, match=r"every test of mpi_skips.py skipped .* at -n 2") as e:
        run_pytest_mpi(2, "mpi_skips.py", timeout=60, env={"MPI_SKIPS_ALL": 1})
    assert "MPI_SKIPS_ALL=1" in str(e.value)      # -rs: the skip reason reaches the report


def test_some_skipped_passes():
    out = run_pytest_mpi(2, "mpi_skips.py", timeout=60).stdout
    assert out.count("1 passed, 1 skipped") == 2, out
