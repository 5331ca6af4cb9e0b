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


def test_nccl_moves_types_it_has_no_name_for():
    """Gather, broadcast and point-to-point move bytes: bool (and bfloat16 on an NCCL without
    NCCL_BFLOAT16) travel unchanged; a reduction of such a type is refused by name."""
    cp = backend.cupy_or_none()
    from pympar.comm import NCCLComm

    c = NCCLComm()
    m = cp.asarray([True, False, True, True])
    assert c.allgather(m).get().tolist() == [True, False, True, True]
    assert c.broadcast(m.copy()).get().tolist() == [True, False, True, True]
    out, _ = c.alltoallv(m, [4])
    assert out.get().tolist() == [True, False, True, True]
    with pytest.raises(TypeError, match="no NCCL type"):
        c.allreduce(m)
    from pympar import gpu

    if gpu.bfloat16_supported():
        h = (np.arange(6, dtype=np.float32) / 4).astype(backend.bfloat16)
        b = c.allgather(cp.asarray(h))
        assert b.dtype == backend.bfloat16 and (b.get().astype(np.float32) == h.astype(np.float32)).all()
