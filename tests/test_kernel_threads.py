"""The C++ kernels' thread pool as the BLAS's threads (pympar.kernels.blas.share_kernel_threads)
and as the runner of over_chunks' ranges (pympar._C.parallel_chunks): same numbers bit for bit,
the hook really used, no deadlock when the pool is already busy, errors carried back."""
import multiprocessing as mp
import threading

import numpy as np
import pytest

from pympar import kernels
from pympar.kernels import blas

_C = pytest.importorskip("pympar._C")
needs_hook = pytest.mark.skipif(not (blas._openblas() and blas._hooks),
                                reason="no OpenBLAS with the caller-managed threading hook")


def _operands(dtype, m=300, k=200, n=260):
    rng = np.random.default_rng(7)
    return rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)


@needs_hook
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_on_kernel_threads_bitwise_equal_to_blas_own_threads(threads, dtype):
    a, b = _operands(dtype)
    threads(1)
    one = a @ b
    threads(2)
    assert blas.kernel_threads_shared() and blas.blas_threads() == 2
    calls = _C.blas_callback_calls()
    shared = a @ b
    assert _C.blas_callback_calls() > calls, "the GEMM did not go through the kernels' pool"
    for hook in blas._hooks:          # OpenBLAS's own threads, same count
        hook(None)
    try:
        own = a @ b
    finally:
        for hook in blas._hooks:
            hook(_C.blas_threads_callback())
    # OpenBLAS splits the work exactly as over its own threads; that split may itself differ from
    # one thread in the last bits, which is OpenBLAS's, not the hook's, doing: float64 here, and
    # float32 on an AVX2 Zen CPU, where elements that cancel to ~0.1 from sums of 200 products of
    # size ~1 differ by 1e-5 -- rounding of the sum, so the tolerance is relative to its scale
    assert np.array_equal(shared, own)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(shared, one, rtol=tol, atol=tol * float(np.abs(one).max()))


@needs_hook
def test_gemm_inside_a_busy_pool_runs_on_temporary_threads(threads):
    # the pool is held by parallel_chunks while a range asks the BLAS for 2 threads: the hook
    # must still run both jobs at once (OpenBLAS's jobs wait for each other), not deadlock
    threads(2)
    a, b = _operands(np.float32)
    want = a @ b
    out = {}

    def rng_fn(i0, i1):
        blas.set_blas_threads(2)
        out[i0] = a @ b
    t = threading.Thread(target=lambda: _C.parallel_chunks(2, 2, rng_fn), daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "GEMM inside a busy pool deadlocked"
    assert set(out) == {0, 1} and all(np.array_equal(v, want) for v in out.values())


@needs_hook
def test_gemms_from_two_python_threads_at_once(threads):
    threads(2)
    a, b = _operands(np.float32)
    want = a @ b
    bad = []

    def work():
        for _ in range(20):
            if not np.array_equal(a @ b, want):
                bad.append(1)
    ts = [threading.Thread(target=work, daemon=True) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "concurrent GEMMs deadlocked"
    assert not bad


def test_parallel_chunks_ranges_errors_and_nesting(threads):
    threads(2)
    seen = []
    _C.parallel_chunks(7, 3, lambda a, b: seen.append((a, b)))
    assert sorted(seen) == [(0, 2), (2, 4), (4, 7)]

    def bad(a, b):
        if a > 0:
            raise KeyError("range failed")
    with pytest.raises(KeyError, match="range failed"):
        _C.parallel_chunks(4, 2, bad)
    # a kernel called inside a range runs inline on that range's thread: same numbers
    x = np.random.default_rng(1).standard_normal((4, 64, 128)).astype(np.float32)
    want = kernels.gelu_forward(x)
    got = np.empty_like(x)

    def rows(a, b):
        got[a:b] = kernels.gelu_forward(x[a:b])
    _C.parallel_chunks(4, 2, rows)
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="parts >= 1"):
        _C.parallel_chunks(4, 0, rows)


def test_more_threads_than_the_pool_holds_is_refused_not_capped():
    before = kernels.get_num_threads()
    assert _C.max_threads == kernels.max_threads() == 255
    for setter in (_C.set_num_threads, kernels.set_num_threads):
        with pytest.raises(ValueError, match="more than the .*255 threads"):
            setter(256)
    assert kernels.get_num_threads() == before and _C.get_num_threads() == before


def test_spin_setting_round_trips():
    before = _C.get_spin_us()
    try:
        _C.set_spin_us(0)
        assert _C.get_spin_us() == 0
        _C.set_spin_us(-5)
        assert _C.get_spin_us() == 0
    finally:
        _C.set_spin_us(before)


def _child(q):
    a, b = _operands(np.float32)
    q.put(float(np.abs((a @ b) - (a.astype(np.float64) @ b)).max()))


@needs_hook
def test_forked_child_gemm_on_rebuilt_pool(threads):
    threads(2)
    _operands(np.float32)[0] @ _operands(np.float32)[1]   # pool and hook in use before the fork
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(timeout=60)
    if p.is_alive():
        p.kill()
        pytest.fail("GEMM in a forked child hung")
    assert p.exitcode == 0
    assert q.get(timeout=5) < 1e-3


def _default_threads(env, prefix=()):
    import os
    import subprocess
    import sys
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    out = subprocess.run([*prefix, sys.executable, "-c", "import pympar.kernels as k, pympar._C as C; "
                          "print(k.get_num_threads(), C.get_num_threads())"], env=dict(e, **env),
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out[0] == out[1], out                # the Python face and the C++ pool agree
    return int(out[0])


def test_a_library_user_gets_numpys_thread_convention():
    """A program that imports pympar and sets nothing: the kernels run as many threads as NumPy's BLAS
    (OMP_NUM_THREADS when set), within the process's CPU affinity -- not one thread whatever is set."""
    import os
    import shutil
    cpus = len(os.sched_getaffinity(0))
    assert _default_threads({"OMP_NUM_THREADS": "1"}) == 1
    if blas._openblas():                        # OpenBLAS took the variable: the kernels follow it
        assert _default_threads({}) == cpus
        if cpus >= 2:
            assert _default_threads({"OMP_NUM_THREADS": "2"}) == 2
    if shutil.which("taskset") and cpus >= 2:   # one CPU allowed: one thread, whatever the BLAS says
        assert _default_threads({}, prefix=("taskset", "-c", str(min(os.sched_getaffinity(0))))) == 1
