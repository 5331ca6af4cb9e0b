"""Gradient compression of the data-parallel sync, inside every rank (any size >= 1)."""
import math

import numpy as np
import pytest

from dp_cases import TINY, dp_communicator, synced_grads

from pympar.data import load_corpus, local_micro_batches
from pympar.nn import GPT, GPTConfig
from pympar.optim import AdamW
from pympar.parallel.dp import DataParallel


@pytest.fixture(scope="module")
def comm(mpi_world):
    return dp_communicator(mpi_world)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("kind,tol", [("fp16", 2e-3), ("bf16", 1e-2)])
def test_cast_compression_close_to_dense_with_half_the_bytes(comm, kind, tol):
    dense, dp0 = synced_grads(comm, TINY, np.float32, 2, bucket_mb=0.01)
    got, dp1 = synced_grads(comm, TINY, np.float32, 2, bucket_mb=0.01, compress=kind)
    rel = {n: _rel(got[n], dense[n]) for n in dense}
    assert max(rel.values()) < tol, rel
    s0, s1 = dp0.stats()["last"], dp1.stats()["last"]
    assert s1["bytes_sent"] * 2 == s0["bytes_sent"]          # exactly half on the wire
    if comm.size > 1:
        assert max(rel.values()) > 0                         # the cast really happened


def test_topk_ratio_one_is_the_dense_mean(comm):
    dense, _ = synced_grads(comm, TINY, np.float64, 2, bucket_mb=0.01)
    got, _ = synced_grads(comm, TINY, np.float64, 2, bucket_mb=0.01, compress="topk:1.0")
    for n in dense:
        np.testing.assert_allclose(got[n], dense[n], rtol=1e-12, atol=1e-15, err_msg=n)


def test_topk_bytes_fall_by_the_ratio(comm):
    ratio = 0.05
    _, dp0 = synced_grads(comm, TINY, np.float32, 1, bucket_mb=0.01)
    _, dp1 = synced_grads(comm, TINY, np.float32, 1, bucket_mb=0.01, compress=f"topk:{ratio}")
    ks = [math.ceil(ratio * b.numel) for b in dp1.buckets]
    dense = dp0.stats()["last"]["payload_bytes"]
    sparse = dp1.stats()["last"]["payload_bytes"]
    if comm.size == 1:
        assert sparse == dense == 0
        return
    assert sparse == sum(k * (4 + 4) for k in ks)            # int32 index + float32 value each
    # the values alone are `ratio` of the dense bytes (up to one element per bucket of rounding)
    assert abs(sum(k * 4 for k in ks) / dense - ratio) <= len(ks) * 4 / dense
    assert dp1.stats()["last"]["bytes_sent"] == (comm.size - 1) * sparse


def _train(comm, compress, steps, corpus):
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)
    model = GPT(cfg, seed=0)
    opt = AdamW(model.named_parameters(), lr=3e-3, weight_decay=0.0)
    dp = DataParallel(model.named_parameters(), comm, bucket_mb=0.02, compress=compress).attach(model)
    losses = []
    for s in range(steps):
        model.zero_grad()
        dp.begin_step()
        dp.begin_micro(last=True)
        (x, y), = local_micro_batches(corpus.train, 1, s, comm.rank, 1, 8, cfg.block_size)
        local = model.loss_and_grad(x, y)
        dp.finish()
        dp.step(opt)
        losses.append(float(np.asarray(comm.allreduce(np.array([local]))).reshape(-1)[0]) / comm.size)
    return losses, dp


def test_topk_with_error_feedback_still_trains_on_text(comm):
    corpus = load_corpus(None)
    steps = 40
    base, _ = _train(comm, None, steps, corpus)
    sparse, dp = _train(comm, "topk:0.05", steps, corpus)
    first, last_base, last_sparse = base[0], np.mean(base[-5:]), np.mean(sparse[-5:])
    if comm.rank == 0:
        print(f"\ntop-k 0.05, dp={comm.size}: loss {first:.3f} -> {last_sparse:.3f} "
              f"(dense {last_base:.3f}); payload {dp.stats()['last']['payload_bytes']} B/step")
    assert last_base < first - 0.5                          # the dense run learns
    assert last_sparse < first - 0.5                        # and so does the sparsified one


def test_compression_composes_with_zero1(comm):
    """ZeRO-1 keeps only its rows of the compressed mean: topk:1.0 sends everything, so the run
    equals the single-process one; with fp16 each rank's rows are close to the dense mean's."""
    from dp_cases import run_dp, run_single

    ref = run_single(TINY, np.float64, 2 * comm.size, 2)
    got = run_dp(comm, TINY, np.float64, 2, 2, bucket_mb=0.004, zero=True, compress="topk:1.0")
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6)
    for n, want in ref["params"].items():
        np.testing.assert_allclose(got["params"][n], want, rtol=1e-6, atol=1e-10, err_msg=n)
    _, dense = synced_grads(comm, TINY, np.float32, 2, bucket_mb=0.004)
    _, half = synced_grads(comm, TINY, np.float32, 2, bucket_mb=0.004, zero=True, compress="fp16")
    for bd, bh in zip(dense.buckets, half.buckets):
        assert bd.names == bh.names
        rows = [(bh.grad_rows(i), v[slice(*bh.layout.rows(i))]) for i, v in enumerate(bd.views)]
        got, want = (np.concatenate([a.reshape(-1) for a in part]) for part in zip(*rows))
        assert _rel(got, want) < 2e-3, bd.names
