"""DataParallel pieces that need no MPI: bucket layouts (flat, and ZeRO's rank-major rows), the
rows a rank keeps as Shards of the full tensor, option errors, and the size-1 path (SelfComm)
equal to plain AdamW for every ZeRO stage."""
import numpy as np
import pytest

from pympar.comm import SelfComm
from pympar.nn import GPT, GPTConfig
from pympar.optim import AdamW, clip_grad_norm
from pympar.parallel.compress import make_compressor
from pympar.parallel.dp import DataParallel, build_buckets
from pympar.parallel.shard import Shard, stacked_slices
from pympar.parallel.zero import RowLayout, rows_shard

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16)


def test_buckets_hold_every_param_once_in_reverse_order_padded_to_dp():
    named = list(GPT(CFG).named_parameters())
    buckets = build_buckets(named, dp=3, bucket_mb=0.004)
    order = [n for b in buckets for n in b.names]
    assert order == [n for n, _ in named][::-1]
    assert len(buckets) > 3
    for b in buckets:
        assert b.padded % 3 == 0 and b.padded - b.numel < 3
        assert b.buf.nbytes <= 0.004 * 2**20 + 3 * 4 or len(b.params) == 1
        for p, v in zip(b.params, b.views):
            assert v.shape == p.grad.shape and np.shares_memory(v, b.buf)


class _Comm:
    """Just a rank and a size: RowLayout and RowBucket need nothing else."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_row_layout_packs_every_rank_its_rows_and_unpacks_back(n):
    rng = np.random.default_rng(n)
    shapes = [(5, 3), (2,), (9, 2, 2), (1, 4)]             # rows fewer than ranks included
    arrays = [rng.standard_normal(s) for s in shapes]
    for r in range(n):
        lay = RowLayout(shapes, n, r)
        flat = lay.pack(arrays, np.full(n * lay.seg, np.nan))
        assert np.isfinite(flat).all()                      # padding is zeros, not garbage
        seg = flat.reshape(n, lay.seg)[r]
        for i, a in enumerate(arrays):
            lo, hi = lay.rows(i)
            part = -(-a.shape[0] // n)
            assert (lo, hi) == (min(r * part, a.shape[0]), min(min(r * part, a.shape[0]) + part, a.shape[0]))
            np.testing.assert_array_equal(lay.own(seg, i), a[lo:hi])
        back = [np.zeros_like(a) for a in arrays]
        lay.unpack(flat, back)
        for a, b in zip(arrays, back):
            np.testing.assert_array_equal(a, b)


def test_rows_shard_composes_with_a_tensor_parallel_shard():
    full = np.arange(24 * 5).reshape(24, 5)
    # c_attn's rows of heads [2, 4) of 8 (C=8): three blocks along dim 0, then rows 1..4 of them
    tp = Shard((24, 5), (stacked_slices(3, 8, slice(2, 4)),))
    local = tp.take(full)                                   # (6, 5)
    for lo, hi in [(0, 6), (1, 4), (2, 3), (5, 6), (3, 3)]:
        sh = rows_shard(tp, (24, 5), lo, hi)
        np.testing.assert_array_equal(sh.take(full), local[lo:hi])
    col = Shard((24, 5), (slice(None), slice(1, 3)))        # a column shard keeps its columns
    np.testing.assert_array_equal(rows_shard(col, (24, 5), 7, 11).take(full), col.take(full)[7:11])
    np.testing.assert_array_equal(rows_shard(None, (24, 5), 7, 11).take(full), full[7:11])


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_keeps_only_this_ranks_rows_of_the_optimizer_state(zero):
    """The ZeRO optimizer's m and v hold this rank's rows and nothing else; ZeRO-3 parameters too
    (and the full tensors of a rank's rows are never made: a slice is initialised alone)."""
    from pympar.parallel.dp import build_buckets

    n = 4
    total = sum(int(np.prod(p.shape)) for _, p in GPT(CFG).named_parameters())
    kept = 0
    for r in range(n):
        named = list(GPT(CFG, seed=3).named_parameters())
        d = DataParallel(named, SelfComm(), zero=zero)      # (size 1: every row) -- then size n:
        d.buckets = build_buckets(named, n, 25.0, _Comm(r, n), zero)
        opt = d.make_optimizer()
        rows = sum(int(np.prod(w.shape)) for _, w, _, _, _ in opt.pieces)
        assert opt.state_bytes() == 2 * rows * 4            # m and v, float32, rows only
        kept += rows
        if zero == 3:
            assert sum(p.data.size for _, p in named) == rows
            full = GPT(CFG, seed=3)
            ref = dict(full.named_parameters())
            for name, p in named:                            # the rows' values are the full tensor's
                np.testing.assert_array_equal(p.shard.take(ref[name].data), p.data)
    assert kept == total                                    # every element kept by exactly one rank


@pytest.mark.parametrize("bad", ["gzip", "topk:0", "topk:1.5"])
def test_bad_compression_names_the_choices(bad):
    with pytest.raises(ValueError, match="expected|must be in"):
        make_compressor(bad)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_size_one_equals_plain_adamw(zero):
    x = np.random.default_rng(0).integers(0, 64, size=(2, 2, 9))
    runs = []
    for use_dp in (False, True):
        model = GPT(CFG, seed=1, dtype=np.float64)
        opt = AdamW(model.named_parameters(), lr=1e-2)
        dp = DataParallel(model.named_parameters(), SelfComm(), bucket_mb=0.004, zero=zero).attach(model) if use_dp else None
        for _ in range(3):
            model.zero_grad()
            for j, t in enumerate(x):
                if dp:
                    dp.begin_micro(last=(j == len(x) - 1))   # no begin_step: finish() ends a step
                model.loss_and_grad(t[:, :-1], t[:, 1:], grad_scale=0.5)
            if dp:
                dp.finish()
                dp.step(opt, clip=0.5)
            else:
                clip_grad_norm(model.parameters(), 0.5)
                opt.step()
        runs.append({n: p.data.copy() for n, p in model.named_parameters()})
    # the attention key bias has an exactly zero true gradient (softmax ignores a shift shared by a
    # query's scores): its values are rounding noise (~1e-15) that any other summation order
    # (zero>=2 sums each micro-batch's synced rows) changes; that slice is held to the noise level
    for n in runs[0]:
        got, want = runs[1][n], runs[0][n]
        if n.endswith("attn.c_attn.bias"):
            C = want.shape[0] // 3
            np.testing.assert_allclose(got[C:2 * C], want[C:2 * C], rtol=0, atol=1e-13, err_msg=n)
            got, want = np.r_[got[:C], got[2 * C:]], np.r_[want[:C], want[2 * C:]]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=n)
