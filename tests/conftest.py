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


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A word-salad text file (20,000 words of 13), for the trainer runs of the failure and
    resharding tests."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog and runs far away".split()
    p = tmp_path_factory.mktemp("data") / "text.txt"
    p.write_text(" ".join(rng.choice(words, 20000)))
    return str(p)
