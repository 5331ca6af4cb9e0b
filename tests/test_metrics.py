"""pympar.metrics: FLOPs per token against the model's own weights, MoE load stats, the peak."""
import numpy as np
import pytest

from pympar.metrics import measure_matmul_peak, moe_layer_stats
from pympar.nn.config import flops_per_token, matmul_params_per_token
from pympar.nn import GPT, GPTConfig


@pytest.mark.parametrize("preset, shared", [("tiny", False), ("moe-tiny", False), ("moe-tiny", True),
                                             ("moe-small", False)])
def test_matmul_params_match_the_models_weights(preset, shared):
    cfg = GPTConfig.from_preset(preset, shared_expert=shared)
    model = GPT(cfg)
    active = 0.0
    for name, p in model.named_parameters():
        if p.data.ndim != 2 or name.endswith("wpe.weight"):
            continue                                    # biases, LayerNorms, position lookup
        frac = cfg.top_k / cfg.n_expert if ".experts." in name else 1.0
        active += frac * p.data.size                    # wte counts once: it is the tied head
    assert matmul_params_per_token(cfg) == active


def test_flops_per_token_tiny_by_hand():
    cfg = GPTConfig.from_preset("tiny")                  # C=32, L=2, V=256, T=64
    n = 2 * (4 + 8) * 32 * 32 + 256 * 32
    assert flops_per_token(cfg) == 6 * n + 12 * 2 * 64 * 32 == 245760


def test_moe_layer_stats():
    s = moe_layer_stats([10, 30, 20, 20])
    assert s["tokens_per_expert"] == [10, 30, 20, 20]
    assert s["max_over_mean"] == pytest.approx(1.5)
    assert s["load_cv"] == pytest.approx(np.std([10, 30, 20, 20]) / 20)
    assert moe_layer_stats([0, 0])["load_cv"] == 0.0


def test_measured_peak_is_the_rate_of_the_products_it_times(monkeypatch):
    """measure_matmul_peak on a clock that moves only inside the products (1 ms each): the rate is
    then exactly 2 n^3 FLOPs per timed product over 1 ms, whatever the machine's load. A FLOP count
    off by 2x, a warm-up product inside the timed window, or a window around other work is not."""
    import pympar.metrics as metrics
    import pympar.nn.products as products

    now, calls = [0.0], []
    real = products.matmul

    def product(a, b, out=None):
        calls.append(a.shape)
        now[0] += 1e-3
        return real(a, b, out=out)

    monkeypatch.setattr(products, "matmul", product)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    n = 64
    rate = metrics.measure_matmul_peak(n=n, seconds=0.0495)
    timed = len(calls) - 1                                   # the first is the warm-up
    assert calls[0] == (n, n) and timed == 50, calls[:3]
    assert rate == pytest.approx(2 * n ** 3 / 1e-3, rel=1e-12), rate


def test_a_full_disk_costs_the_metrics_log_not_the_run(capsys):
    """/dev/full answers every write with ENOSPC, as a full disk does: the writer warns once and stops
    writing; training code calling it goes on."""
    import os
    from pympar.metrics import MetricsWriter
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    w = MetricsWriter("/dev/full")
    w.write({"step": 0, "loss": 1.0})
    w.write({"step": 1, "loss": 0.9})
    w.close()
    err = capsys.readouterr().err
    assert err.count("cannot write /dev/full") == 1 and "No space left on device" in err, err
