"""Expert parallelism inside every rank: dp = world size, ep over every divisor of dp that divides
n_expert, against the single-process model accumulating the same global micro-batches
(docs/design.md, Determinism), through the trainer's gradient path (GradSync). Holds for any size
1..8. float64: grads rel 1e-10, params rel 1e-6."""
import os

import numpy as np
import pytest

from pympar.nn import GPT
from pympar.nn.config import GPTConfig
from pympar.optim import AdamW, clip_grad_norm
from pympar.parallel.ep import ep_step_stats, install_expert_parallel
from pympar.parallel.gradsync import GradSync
from pympar.parallel.mesh import Mesh
from pympar.parallel.meter import Meter
from pympar.parallel.shard import shard_of
from pympar.parallel.tp import TPGPT

def is_expert_param(name):
    """The experts by their names (the oracle; the library places them by the module that holds them)."""
    return ".moe.experts." in name


MOE = dict(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, n_expert=4, top_k=2)
B, T, LR, CLIP, SEED = 2, 8, 1e-2, 0.05, 3
ROUTING = {"dropless": 0.0, "capacity": 0.75}
FULL = os.environ.get("PYMPAR_EP_FULL") == "1"


@pytest.fixture(scope="module")
def world(mpi_world):
    from pympar.comm import MPIComm

    return MPIComm(mpi_world)


def eps_for(size, n_expert=MOE["n_expert"]):
    return [e for e in range(1, size + 1) if size % e == 0 and n_expert % e == 0]


def global_batch(step, n_global, vocab=64):
    rng = np.random.default_rng([17, step])
    toks = rng.integers(0, vocab, size=(n_global, B, T + 1))
    return [(t[:, :-1], t[:, 1:]) for t in toks]


def _cfg(routing, **kw):
    return GPTConfig(**dict(MOE, capacity_factor=ROUTING[routing], **kw))


def run_single(cfg, n_global, steps, prepare=None):
    """One process, gradient accumulation over the whole global batch: grads of step 0, losses,
    norms, params after the steps. prepare(model): a change made to the model before training."""
    model = GPT(cfg, seed=SEED, dtype=np.float64)
    if prepare is not None:
        prepare(model)
    opt = AdamW(model.named_parameters(), lr=LR)
    out = dict(losses=[], norms=[])
    for s in range(steps):
        model.zero_grad()
        mbs = global_batch(s, n_global, cfg.vocab_size)
        out["losses"].append(sum(model.loss_and_grad(x, y, grad_scale=1.0 / n_global) for x, y in mbs) / n_global)
        if s == 0:
            out["grads"] = {n: p.grad.copy() for n, p in model.named_parameters()}
        out["norms"].append(clip_grad_norm(model.parameters(), CLIP))
        opt.step()
    out["params"] = {n: p.data.copy() for n, p in model.named_parameters()}
    return out


def run_ep(world, cfg, ep, n_micro, steps, tp=1, sp=False, dispatch="flat", prepare=None, replicas=None, **dp_kw):
    """The same steps on dp = world.size / tp ranks with expert parallelism ep (and tensor
    parallelism tp); dp rank r runs the global micro-batches r*n_micro .. (r+1)*n_micro - 1.
    replicas: the copies (parallel.replicas.place_replicas) every MoE layer runs with, refreshed
    after each optimizer step as the trainer does."""
    dp = world.size // tp
    mesh = Mesh(world, dp=dp, tp=tp, ep=ep)
    if tp == 1:
        model = GPT(cfg, seed=SEED, dtype=np.float64)
    else:
        model = TPGPT(cfg, mesh.tp_comm, seed=SEED, dtype=np.float64, sequence_parallel=sp)
    if prepare is not None:
        prepare(model)
    model = install_expert_parallel(model, mesh.ep_comm, dispatch=dispatch)
    layers = [m for _, m in model.moe_layers()]
    if replicas is not None:
        for m in layers:
            m.expert_parallel.set_replicas(replicas)
    named = list(model.named_parameters())
    sync = GradSync(named, mesh, **dp_kw).attach(model)        # the trainer's gradient path
    opt = sync.make_optimizer(lr=LR)
    n_global = n_micro * dp
    out = dict(losses=[], norms=[], mesh=mesh, model=model)
    for s in range(steps):
        model.zero_grad()
        sync.begin_step()
        mine = global_batch(s, n_global, cfg.vocab_size)[mesh.dp_rank * n_micro:(mesh.dp_rank + 1) * n_micro]
        local = 0.0
        for j, (x, y) in enumerate(mine):
            sync.begin_micro(last=j == n_micro - 1)
            local += model.loss_and_grad(x, y, grad_scale=1.0 / n_micro)
        sync.finish()
        tot = np.asarray(mesh.dp_comm.allreduce(np.array([local / n_micro]))).reshape(-1)[0]
        out["losses"].append(float(tot) / dp)
        if s == 0:
            out["grads"] = {n: p.grad.copy() for n, p in model.named_parameters()}
        total_sq = float(np.asarray(world.allreduce(np.array([sync.local_sq()]))).reshape(-1)[0])
        out["norms"].append(sync.step(opt, LR, CLIP, total_sq))
        if replicas is not None:
            for m in layers:
                m.expert_parallel.refresh_replicas()
    out["params"] = {n: p.data.copy() for n, p in model.named_parameters()}
    out["shards"] = {n: shard_of(p) for n, p in model.named_parameters()}
    return out


def _assert_tensors(got, want, rtol, what, layout, shards=None):
    """Every tensor of got (this rank's names; a tp shard: its slice) equals want's; the message
    names the first that differs."""
    for n, g in got.items():
        sh = (shards or {}).get(n)
        w = want[n] if sh is None else sh.take(want[n])
        atol = rtol * max(float(np.abs(w).max()), 1e-300)
        if not np.allclose(g, w, rtol=rtol, atol=atol):
            err = float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-300))
            raise AssertionError(f"{layout}: {what} {n} differs (max |diff|/max|want| = {err:.3e} > {rtol})")


@pytest.mark.parametrize("routing", list(ROUTING))
def test_ep_loss_grads_params_match_single_process(world, routing):
    n_micro, steps = 2, 3
    cfg = _cfg(routing)
    ref = run_single(cfg, n_micro * world.size, steps)
    for ep in eps_for(world.size):
        layout = f"dp={world.size} ep={ep} {routing}"
        got = run_ep(world, cfg, ep, n_micro, steps)
        names = set(got["grads"])
        experts = {n for n in names if is_expert_param(n)}
        # this rank holds exactly its n_expert/ep experts, under their global names
        lo = got["mesh"].ep_rank * (cfg.n_expert // ep)
        held = {int(n.split(".")[5]) for n in experts}
        assert held == set(range(lo, lo + cfg.n_expert // ep)), (layout, sorted(held))
        assert names - experts == {n for n in ref["grads"] if not is_expert_param(n)}, layout
        _assert_tensors(got["grads"], ref["grads"], 1e-10, "gradient (step 0, after sync)", layout)
        # step 0 exactly; later steps 1e-6 (AdamW turns rounding noise in exactly-zero true
        # gradients, the attention key bias, into lr-sized steps in any layout)
        np.testing.assert_allclose(got["losses"][0], ref["losses"][0], rtol=1e-12, err_msg=layout)
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6, err_msg=layout)
        np.testing.assert_allclose(got["norms"][0], ref["norms"][0], rtol=1e-10, err_msg=f"{layout}: global norm")
        np.testing.assert_allclose(got["norms"], ref["norms"], rtol=1e-6, err_msg=f"{layout}: global norm")
        assert ref["norms"][0] > CLIP, "the clipping threshold must bite for the norm to matter"
        _assert_tensors(got["params"], ref["params"], 1e-6, f"parameter after {steps} AdamW steps", layout)


@pytest.mark.parametrize("routing,sp", [("dropless", True), ("capacity", False)])
def test_ep_with_tensor_parallel_matches_single_process(world, routing, sp):
    """tp = 2: every local expert is further split along its hidden width over tp."""
    if world.size % 2:
        pytest.skip("tp=2 needs an even world size")
    n_micro, steps, tp = 2, 2, 2
    dp = world.size // tp
    cfg = _cfg(routing)
    ref = run_single(cfg, n_micro * dp, steps)
    for ep in eps_for(dp):
        layout = f"dp={dp} tp={tp} ep={ep} sp={sp} {routing}"
        got = run_ep(world, cfg, ep, n_micro, steps, tp=tp, sp=sp)
        assert any(sh is not None for n, sh in got["shards"].items() if is_expert_param(n)), layout
        _assert_tensors(got["grads"], ref["grads"], 1e-10, "gradient (step 0, after sync)", layout, got["shards"])
        # step 0 exactly; later steps 1e-6 (AdamW turns rounding noise in exactly-zero true
        # gradients, the attention key bias, into lr-sized steps in any layout)
        np.testing.assert_allclose(got["losses"][0], ref["losses"][0], rtol=1e-12, err_msg=layout)
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6, err_msg=layout)
        np.testing.assert_allclose(got["norms"][0], ref["norms"][0], rtol=1e-10, err_msg=f"{layout}: global norm")
        np.testing.assert_allclose(got["norms"], ref["norms"], rtol=1e-6, err_msg=f"{layout}: global norm")
        _assert_tensors(got["params"], ref["params"], 1e-6, f"parameter after {steps} AdamW steps", layout,
                        got["shards"])


def test_capacity_drops_the_single_process_tokens(world):
    """Every rank routes the SAME micro-batch: the kept assignments of every MoE layer are exactly
    the single-process model's, some are dropped, and the outputs agree."""
    cfg = _cfg("capacity")
    x, y = global_batch(5, 1, cfg.vocab_size)[0]
    ref = GPT(cfg, seed=SEED, dtype=np.float64)
    ce_r, aux_r, (_, ctx_r, _) = ref._forward(x, y)
    for ep in eps_for(world.size):
        mesh = Mesh(world, dp=world.size, ep=ep)
        model = install_expert_parallel(GPT(cfg, seed=SEED, dtype=np.float64), mesh.ep_comm)
        ce, aux, (_, ctxs, _) = model._forward(x, y)
        for i, (a, b) in enumerate(zip(ctxs, ctx_r)):
            kept, kept_r = a["ffn"]["order"], b["ffn"]["order"]
            assert len(kept_r) < B * T * cfg.top_k, f"layer {i}: the capacity must drop something"
            np.testing.assert_array_equal(kept, kept_r, err_msg=f"ep={ep} layer {i}: kept assignments differ")
            np.testing.assert_allclose(a["ffn"]["ectx"][0], b["ffn"]["ectx"][0], rtol=1e-12, atol=1e-14)   # expert outputs
        np.testing.assert_allclose([ce, aux], [ce_r, aux_r], rtol=1e-12)


def test_ep_own_micro_batches_drop_like_single_process(world):
    """Different micro-batches per rank: each rank's drops are the single-process drops of ITS micro-batch."""
    cfg = _cfg("capacity")
    mbs = global_batch(7, world.size, cfg.vocab_size)
    ref = GPT(cfg, seed=SEED, dtype=np.float64)
    ep = eps_for(world.size)[-1]
    mesh = Mesh(world, dp=world.size, ep=ep)
    model = install_expert_parallel(GPT(cfg, seed=SEED, dtype=np.float64), mesh.ep_comm)
    x, y = mbs[mesh.dp_rank]
    _, _, (_, ctxs, _) = model._forward(x, y)
    _, _, (_, ctx_r, _) = ref._forward(x, y)
    for i, (a, b) in enumerate(zip(ctxs, ctx_r)):
        np.testing.assert_array_equal(a["ffn"]["order"], b["ffn"]["order"], err_msg=f"ep={ep} layer {i}")


def test_parameter_groups_and_stats(world):
    cfg = _cfg("capacity")
    ep = eps_for(world.size)[-1]
    mesh = Mesh(world, dp=world.size, ep=ep)
    meter = Meter()
    model = install_expert_parallel(GPT(cfg, seed=SEED, dtype=np.float64), mesh.ep_comm, meter)
    named = list(model.named_parameters())
    dense = [(n, p) for n, p in named if not is_expert_param(n)]
    expert = [(n, p) for n, p in named if is_expert_param(n)]
    assert all(".moe.experts." in n for n, _ in expert) and not any(".moe.experts." in n for n, _ in dense)
    assert any(".moe.router." in n for n, _ in dense), "the router is dense (synced over all dp)"
    assert len(expert) == cfg.n_layer * (cfg.n_expert // ep) * 4
    n_micro = 2
    mbs = global_batch(0, n_micro * world.size, cfg.vocab_size)
    for x, y in mbs[mesh.dp_rank * n_micro:(mesh.dp_rank + 1) * n_micro]:
        model.loss_and_grad(x, y)
    meter.add("tp", 1.5)                                      # another part's tally: left alone
    stats = ep_step_stats(model, meter, mesh.dp_comm)
    assert meter.get("tp").seconds == 1.5 and not any(isinstance(k, tuple) for k in meter.take())
    # the oracle: the single-process model over the whole global batch
    ref = GPT(cfg, seed=SEED, dtype=np.float64)
    for x, y in mbs:
        ref.loss_and_grad(x, y)
    want = ref.moe_stats()
    assert [s["layer"] for s in stats] == [w["layer"] for w in want]
    for s, w in zip(stats, want):
        assert s["routed_per_expert"] == w["tokens_per_expert"], (s, w)
        assert abs(s["dropped_fraction"] - w["dropped_fraction"]) < 1e-12
        assert sum(s["tokens_per_expert"]) == round(len(mbs) * B * T * cfg.top_k * (1 - w["dropped_fraction"]))
        load = np.array(s["tokens_per_expert"], float)
        assert abs(s["load_cv"] - load.std() / load.mean()) < 1e-12
        assert abs(s["max_over_mean"] - load.max() / load.mean()) < 1e-12
        assert s["a2a_seconds"] > 0 and s["a2a_bytes"] > 0
    again = ep_step_stats(model, meter, mesh.dp_comm)                # counters were reset
    assert all(sum(s["tokens_per_expert"]) == 0 and s["a2a_seconds"] == 0 and s["a2a_bytes"] == 0 for s in again)
