import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
collect_ignore = ["mpi"]

import pytest  # noqa: E402


@pytest.fixture
def threads():
    """use(n): run the kernels (and the BLAS) on n threads for this test; 1 again afterwards."""
    from pympar import kernels

    def use(n):
        kernels.set_num_threads(n)
    yield use
    kernels.set_num_threads(1)
