"""Replicated hot experts (parallel/replicas.py, parallel/ep.py) under mpiexec (tests/test_replicas.py
runs it at 4 ranks): a router skewed towards a few experts, replicas placed from the loads every
rank agrees on, trained against the single-process run (float64: gradients rel 1e-10 after the
replicas' gradients are folded into their homes, parameters rel 1e-6 after AdamW steps that refresh
the replicas), and the rows per rank evened out."""
import numpy as np
import pytest

from mpi_ep import _assert_tensors, _cfg, global_batch, run_ep, run_single
from pympar.parallel.ep import ep_step_stats, install_expert_parallel
from pympar.parallel.mesh import Mesh
from pympar.parallel.meter import Meter
from pympar.parallel.replicas import place_replicas
from pympar.nn import GPT

SKEW = 1.5


def skew(model):
    """Selection bias log(1/rank^s) on every MoE layer: a Zipf-like preference for the first experts
    (the bias moves no gate, only which experts are chosen)."""
    for _, m in model.moe_layers():
        m.expert_bias[...] = -SKEW * np.log1p(np.arange(m.n_expert))


@pytest.fixture(scope="module")
def world(mpi_world):
    from pympar.comm import MPIComm

    return MPIComm(mpi_world)


def _loads(world, cfg):
    """Tokens per expert of layer 0 over one global batch, from the model without replicas."""
    mesh = Mesh(world, dp=world.size, ep=world.size)
    meter = Meter()
    model = GPT(cfg, seed=3, dtype=np.float64)
    skew(model)
    model = install_expert_parallel(model, mesh.ep_comm, meter)
    x, y = global_batch(0, world.size, cfg.vocab_size)[world.rank]
    model.loss_and_grad(x, y)
    return model, mesh, meter, ep_step_stats(model, meter, mesh.dp_comm)


def test_placement_is_the_same_on_every_rank_and_evens_the_rows(world, mpi_world):
    cfg = _cfg("dropless", n_expert=2 * world.size)
    model, mesh, meter, stats = _loads(world, cfg)
    loads = stats[0]["tokens_per_expert"]
    before = stats[0]["rank_max_over_mean"]
    copies = place_replicas(loads, world.size, 1)
    assert all(c == copies for c in mpi_world.allgather(copies))
    for _, m in model.moe_layers():
        m.expert_parallel.set_replicas(place_replicas(loads, world.size, 1))
    x, y = global_batch(0, world.size, cfg.vocab_size)[world.rank]
    model.zero_grad()
    model.loss_and_grad(x, y)
    after = ep_step_stats(model, meter, mesh.dp_comm)
    assert after[0]["tokens_per_expert"] == loads                 # the same tokens, spread differently
    assert before > 1.3 and after[0]["rank_max_over_mean"] < before


@pytest.mark.parametrize("slots", [1, 2])
def test_replicas_train_like_single_process(world, slots):
    cfg = _cfg("dropless", n_expert=2 * world.size)
    n_micro, steps = 2, 3
    ref = run_single(cfg, n_micro * world.size, steps, prepare=skew)
    _, _, _, stats = _loads(world, cfg)
    copies = place_replicas(stats[0]["tokens_per_expert"], world.size, slots)
    assert sum(len(c) - 1 for c in copies) == slots * world.size
    got = run_ep(world, cfg, world.size, n_micro, steps, prepare=skew, replicas=copies)
    layout = f"dp=ep={world.size} replicas {slots} per rank"
    _assert_tensors(got["grads"], ref["grads"], 1e-10, "gradient (step 0, after sync)", layout, got["shards"])
    np.testing.assert_allclose(got["losses"][0], ref["losses"][0], rtol=1e-12, err_msg=layout)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6, err_msg=layout)
    _assert_tensors(got["params"], ref["params"], 1e-6, f"parameter after {steps} AdamW steps", layout, got["shards"])
    for _, m in got["model"].moe_layers():                      # the replicas hold their homes' weights
        assert len(m.expert_parallel.replica_modules) == slots


def test_a_deferred_w_pass_is_refused(world):
    """Under a zero-bubble W pass the replicas' weight gradients come after the fold: refused, on
    every rank alike (after the exchange every rank runs)."""
    from pympar.nn.wgrad import WeightGrads

    cfg = _cfg("dropless", n_expert=2 * world.size)
    model, *_ , stats = _loads(world, cfg)
    for _, m in model.moe_layers():
        m.expert_parallel.set_replicas(place_replicas(stats[0]["tokens_per_expert"], world.size, 1))
    x, y = global_batch(1, world.size, cfg.vocab_size)[world.rank]
    with pytest.raises(ValueError, match="deferred W pass"):
        with WeightGrads():
            model.loss_and_grad(x, y)
