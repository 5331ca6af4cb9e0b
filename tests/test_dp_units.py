"""DataParallel pieces that need no MPI: bucket layout, memory report, option errors, and the
size-1 path (SelfComm) equal to plain AdamW."""
import numpy as np
import pytest

from pympar.comm import SelfComm
from pympar.nn import GPT, GPTConfig
from pympar.optim import AdamW, clip_grad_norm
from pympar.parallel.compress import make_compressor
from pympar.parallel.dp import DataParallel, build_buckets
from pympar.parallel.zero import optimizer_memory

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


def test_zero1_memory_is_three_words_per_owned_element():
    named = list(GPT(CFG).named_parameters())
    n = sum(p.data.size for _, p in named)
    for dp in (1, 2, 4):
        rep = optimizer_memory(build_buckets(named, dp, 0.01), dp, zero=True)
        assert rep["plain_dp_bytes"] == 8 * n
        assert 12 * n / dp <= rep["optimizer_bytes"] < 12 * (n / dp + len(build_buckets(named, dp, 0.01)))
    assert optimizer_memory(build_buckets(named, 4, 0.01), 4, zero=False)["ratio_to_plain"] == 1.0


@pytest.mark.parametrize("bad", ["gzip", "topk:0", "topk:1.5"])
def test_bad_compression_names_the_choices(bad):
    with pytest.raises(ValueError, match="expected|must be in"):
        make_compressor(bad)


@pytest.mark.parametrize("zero", [False, True])
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
    for n in runs[0]:
        np.testing.assert_allclose(runs[1][n], runs[0][n], rtol=1e-12, atol=1e-15, err_msg=n)
