"""save_run (pympar.resilience) stops every rank together when any rank's parameters are non-finite."""
import pytest

from mpirun import run_pytest_mpi


@pytest.mark.parametrize("n", [1, 2, 3])
def test_save_run_agrees_on_non_finite_parameters(n):
    run_pytest_mpi(n, "mpi_save_agree.py", timeout=60)
