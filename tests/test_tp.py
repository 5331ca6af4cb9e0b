"""Tensor parallelism: the one-process pieces (Shard, vocab-parallel cross-entropy on simulated
shards, validation) and the MPI runs of tests/mpi/mpi_tp.py on 1, 2 and 4 ranks."""
import numpy as np
import pytest

from mpirun import run_pytest_mpi
from pympar.kernels.reference import cross_entropy_backward, cross_entropy_forward
from pympar.nn import GPTConfig
from pympar.parallel.shard import Shard, padded_slice, stacked_slices
from pympar.parallel.tp import validate_tp
from pympar.parallel.tp.cross_entropy import (finish_loss, local_row_max, local_row_sums,
                                              vocab_parallel_cross_entropy_backward)


def test_shard_union_of_blocks_roundtrip():
    C, tp = 8, 4
    full = np.arange(3 * C * 5, dtype=np.float64).reshape(3 * C, 5)
    back = np.zeros_like(full)
    for r in range(tp):
        sh = Shard(full.shape, (stacked_slices(3, C, slice(2 * r, 2 * r + 2)),))
        assert sh.local_shape == (6, 5) and not sh.is_contiguous
        loc = sh.take(full)
        np.testing.assert_array_equal(loc[2:4], full[C + 2 * r:C + 2 * r + 2])   # rank's k rows
        for freg, lreg in sh.pieces():
            np.testing.assert_array_equal(loc[tuple(slice(*p) for p in lreg)],
                                          full[tuple(slice(*p) for p in freg)])
        sh.put(back, loc)
        assert Shard.from_json(sh.to_json()) == Shard.from_json(sh.to_json())
        np.testing.assert_array_equal(Shard.from_json(sh.to_json()).take(full), loc)
    np.testing.assert_array_equal(back, full)      # the shards tile the tensor


@pytest.mark.parametrize("V,tp", [(37, 1), (37, 2), (37, 4), (5, 4), (3, 4)])
def test_vocab_parallel_cross_entropy_on_simulated_shards(V, tp):
    """The three phases over tp simulated vocabulary parts (padding -inf) reproduce the fused
    reference kernel; a rank may own no real column at all (V=3, tp=4)."""
    rng = np.random.default_rng(0)
    N = 11
    logits = rng.standard_normal((N, V)) * 3
    t = rng.integers(0, V, N)
    t[3] = -1
    loss_ref, lse_ref = cross_entropy_forward(logits, t)
    dl_ref = cross_entropy_backward(logits, lse_ref, t, 0.7)
    part = -(-V // tp)
    parts = []
    for r in range(tp):
        sl = padded_slice(V, tp, r)
        loc = np.full((N, part), -np.inf)
        loc[:, :sl.stop - sl.start] = logits[:, sl]
        parts.append((sl, loc))
    m = np.max([local_row_max(loc) for _, loc in parts], axis=0)
    sums = np.sum([local_row_sums(loc, t, sl.start, m) for sl, loc in parts], axis=0)
    loss, lse = finish_loss(m, sums, t)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-13)
    np.testing.assert_allclose(lse[t >= 0], lse_ref[t >= 0], rtol=1e-13)
    dl = np.concatenate([vocab_parallel_cross_entropy_backward(loc, lse, t, sl.start, 0.7)
                         for sl, loc in parts], axis=1)
    np.testing.assert_allclose(dl[:, :V], dl_ref, rtol=1e-12, atol=1e-15)
    assert not dl[:, V:].any(), "padding columns must get no gradient"


@pytest.mark.parametrize("kw,tp,msg", [
    (dict(n_head=3, n_embd=24), 2, "n_head=3 is not divisible by tp=2"),
    (dict(n_head=6, n_embd=24), 4, "n_head=6 is not divisible by tp=4"),
    (dict(), 0, "tp=0 must be an integer >= 1"),
])
def test_validate_tp_rejects(kw, tp, msg):
    with pytest.raises(ValueError, match=msg):
        validate_tp(GPTConfig(**dict(dict(vocab_size=37, block_size=8, n_head=2, n_embd=16), **kw)), tp)


def test_validate_tp_sequence_length():
    cfg = GPTConfig(vocab_size=37, block_size=8, n_head=4, n_embd=16)
    with pytest.raises(ValueError, match="T=6 is not divisible by tp=4"):
        validate_tp(cfg, 4, sequence_parallel=True, seq_len=6)
    assert validate_tp(cfg, 4, sequence_parallel=False, seq_len=6) is cfg


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 4])
def test_tp_under_mpi(n):
    run_pytest_mpi(n, "mpi_tp.py", timeout=120)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_tp_under_mpi_exhaustive(n):
    run_pytest_mpi(n, "mpi_tp.py", timeout=600, env={"PYMPAR_TP_SLOW": "1"})
