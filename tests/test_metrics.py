"""pympar.metrics: FLOPs per token against the model's own weights, MoE load stats, the peak."""
import numpy as np
import pytest

from pympar.metrics import flops_per_token, matmul_params_per_token, measure_matmul_peak, moe_layer_stats
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


def test_measured_peak_is_plausible():
    peak = measure_matmul_peak(seconds=0.05)
    assert 1e8 < peak < 1e13                             # 0.1 GFLOP/s .. 10 TFLOP/s on one CPU process
