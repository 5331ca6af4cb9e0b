"""The CUDA bindings check their arguments before any launch, as the C++ module does: objects
with __cuda_array_interface__ whose dtype, element count, C order or writability is wrong are
refused with a ValueError naming the argument. Runs wherever pympar._cuda is built (CI compiles it
with nvcc), GPU or not: the fake arrays below point at host memory, and on a machine without a
driver the device query refuses the calls that pass every other check."""
import numpy as np
import pytest

_cuda = pytest.importorskip("pympar._cuda", reason="pympar._cuda is not built (no CUDA compiler)")


class Fake:
    """A host buffer dressed as a CUDA array (never launched on: every case fails a check)."""

    def __init__(self, shape, dtype=np.float32, readonly=False, strides=None):
        self.a = np.zeros(shape, dtype)
        self.__cuda_array_interface__ = dict(shape=self.a.shape, typestr=self.a.dtype.str, version=3,
                                             data=(self.a.ctypes.data, readonly), strides=strides)


def F(*shape, dtype=np.float32, **kw):
    return Fake(shape, dtype, **kw)


@pytest.mark.parametrize("call, match", [
    (lambda: _cuda.gelu_forward(np.zeros(4, np.float32), F(4), 0), "gelu_forward: x must be a CUDA array"),
    (lambda: _cuda.gelu_forward(F(4, dtype=np.float64), F(4), 0), r"gelu_forward: x has dtype <f8 \(float64\)"),
    (lambda: _cuda.gelu_forward(F(4), F(3), 0), "gelu_forward: y has 3 elements; expected 4"),
    (lambda: _cuda.gelu_forward(F(4), F(4, readonly=True), 0), "y is read-only"),
    (lambda: _cuda.gelu_backward(F(3, 4, strides=(4, 12)), F(12), F(12), 0), "x must be C-contiguous"),
    (lambda: _cuda.gelu_forward(F(4), F(4, dtype=np.float16), 0), r"y has dtype <f2 \(float16\); expected float32"),
    (lambda: _cuda.attention_forward(F(2, 8, 3, 4), F(2, 8, 16), F(2, 4, 8), 1.0, 0), r"qkv must be \(B, T, 3, H, D\)"),
    (lambda: _cuda.attention_forward(F(2, 8, 3, 4, 16), F(2, 8, 64), F(2, 4, 7), 1.0, 0), "lse has 56 elements; expected 64"),
    (lambda: _cuda.layernorm_forward(F(4, 8), F(8), F(7), F(4, 8), F(4), F(4), 1e-5, 0), "b has 7 elements; expected 8"),
    (lambda: _cuda.layernorm_backward(F(4, 8), F(4, 8), F(8), F(4), F(4), F(4, 8), F(8), F(8), F(1), 0),
     r"scratch has 1 elements; needs layernorm_backward_scratch\(N, C\)"),
    (lambda: _cuda.cross_entropy_forward(F(5, 10), F(5, dtype=np.int32), F(5), F(5), 0), "targets has dtype <i4"),
    (lambda: _cuda.cross_entropy_backward(F(5, 10), F(5), F(5, dtype=np.int64), F(3), F(5, 10), 0),
     "dloss has 3 elements; expected 1 or N = 5"),
    (lambda: _cuda.adamw_step(F(6), F(6), F(6), F(5), 1e-3, 0.9, 0.95, 1e-8, 0.0, 0.1, 0.05, 0), "v has 5 elements"),
    (lambda: _cuda.topk(F(6, 4), 2, F(6, 3, dtype=np.int64), F(6, 2), 0), "idx has 18 elements; expected 12"),
    (lambda: _cuda.capacity_positions(F(9, dtype=np.int64), 4, 0, F(9, dtype=np.int64), F(5, dtype=np.int64), 0),
     "counts has 5 elements; expected 4"),
    (lambda: _cuda.permute(F(6, 4), F(3, dtype=np.int64), F(3, 4, dtype=np.float16), 0), "out has dtype <f2; x has <f4"),
    (lambda: _cuda.unpermute_add(F(6, 4), F(6, dtype=np.int64), F(4, dtype=np.int64), None, F(4, 4), 4, 0),
     "offsets has 4 elements; expected 5"),
    (lambda: _cuda.reduce_inplace(F(4), F(4, dtype=np.float64), 0, 0), "src has dtype <f8"),
    (lambda: _cuda.reduce_inplace(F(4), F(4), 7, 0), "op must be 0..3"),
])
def test_a_wrong_argument_is_refused_before_the_launch(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_host_memory_is_refused_by_the_device_check():
    """Every cheap check passes; the last one asks where the memory is: host memory is refused
    (on a GPU machine: "not in device memory"; without a driver the query itself fails)."""
    with pytest.raises((ValueError, RuntimeError), match="device"):
        _cuda.gelu_forward(F(4), F(4), 0)
