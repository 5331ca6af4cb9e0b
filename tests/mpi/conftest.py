"""Fixtures for tests that run inside every rank of an mpiexec job."""
import pytest


@pytest.fixture(scope="session")
def mpi_world():
    from mpi4py import MPI

    return MPI.COMM_WORLD
