"""NCCLComm on a GPU (skipped without CuPy and a device): every verb against NumPy."""
import numpy as np
import pytest

from pympar import backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA GPU")]


def test_nccl_single_rank_verbs():
    cp = backend.cupy_or_none()
    from pympar.comm import NCCLComm

    c = NCCLComm()
    x = cp.arange(10, dtype=cp.float32)
    np.testing.assert_allclose(c.allreduce(x.copy(), op="avg").get(), np.arange(10))
    np.testing.assert_allclose(c.allgather(x).get(), np.arange(10))
    np.testing.assert_allclose(c.reduce_scatter(x).get(), np.arange(10))
    out, rc = c.alltoallv(x, [10])
    assert rc.tolist() == [10] and (out.get() == np.arange(10)).all()
    c.barrier()
