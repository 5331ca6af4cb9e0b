"""For tests/test_mpirun.py: one test always skips; the other skips too when MPI_SKIPS_ALL=1."""
import os

import pytest


def test_always_skipped():
    pytest.skip("skipped on purpose (tests/test_mpirun.py)")


def test_passes_unless_all_skip(mpi_world):
    if os.environ.get("MPI_SKIPS_ALL") == "1":
        pytest.skip("MPI_SKIPS_ALL=1")
    assert mpi_world.size >= 1
