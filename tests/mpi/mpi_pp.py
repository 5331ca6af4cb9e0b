"""Pipeline parallelism inside every rank: the whole world is one pipeline (pp = world size).

Each test compares this rank's stage against the single-process nn.GPT doing gradient
accumulation over the same micro-batches (float64, relative 1e-10): loss, every gradient of
the parameters this rank holds, and the parameters after a few AdamW steps.
PYMPAR_PP_FULL=1 runs the exhaustive matrix (tests/test_pp.py's slow test sets it).
"""
import os

import numpy as np
import pytest

from pympar.nn import GPT, GPTConfig
from pympar.optim import AdamW
from pympar.parallel.pp import PipelineExecutor, PipelineGPT, validate_pipeline
from pympar.parallel.pp.schedules import SPLIT_BACKWARD, measured_costs, placement_of

FULL = os.environ.get("PYMPAR_PP_FULL") == "1"
# tests/test_pp.py runs this file once more with PYMPAR_PP_CHANNELS=1: every executor on ordered channels
CHANNELS = {"1": True, "0": False}.get(os.environ.get("PYMPAR_PP_CHANNELS", "").strip())


def Executor(model, comm, schedule="1f1b", **kw):
    return PipelineExecutor(model, comm, schedule, channels=CHANNELS, **kw)
TOL = 1e-10


def pp_comm(world):
    from pympar.comm import MPIComm
    return MPIComm(world)


def config(p, v=1, moe=False, capacity=0.0, n_layer=None):
    kw = dict(vocab_size=64, block_size=16, n_layer=n_layer or max(2, p * v), n_head=2, n_embd=16)
    if moe:
        kw.update(n_expert=4, top_k=2, moe_every=1, capacity_factor=capacity)
    return GPTConfig(**kw)


def micro_batches(m, B=2, T=8, vocab=64, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))) for _ in range(m)]


def rel(a, b):
    den = max(float(np.abs(b).max()), 1e-30)
    return float(np.abs(a - b).max()) / den


def reference_step(ref, mbs):
    ref.zero_grad()
    return float(np.mean([ref.loss_and_grad(i, t, grad_scale=1.0 / len(mbs)) for i, t in mbs]))


def compare(world, model, ref, what):
    want = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        for kind in what:
            a, b = getattr(p, kind), getattr(want[n], kind)
            e = rel(a, b)
            assert e <= TOL, f"rank {world.rank}: {kind} of {n} differs from single process, rel {e:.2e}"


def train_against_one_process(world, model, ex, cfg, m, steps, seed):
    """``steps`` AdamW steps of the pipeline and of one process (nn.GPT, seed 3) on the same m
    micro-batches each: the loss, every gradient and every weight equal at TOL after each step
    (and the weights at the end). Yields (the executor's stats, the micro-batches) per step."""
    ref = GPT(cfg, seed=3, dtype=np.float64)
    opt, ropt = AdamW(model.named_parameters(), lr=1e-2), AdamW(ref.named_parameters(), lr=1e-2)
    for step in range(steps):
        mbs = micro_batches(m, seed=seed + step)
        model.zero_grad()
        st = ex.train_step(mbs)
        want = reference_step(ref, mbs)
        assert abs(st["loss"] - want) <= TOL * abs(want), (ex.schedule, step, st["loss"], want)
        compare(world, model, ref, ("data", "grad"))
        opt.step()
        ropt.step()
        yield st, mbs
    compare(world, model, ref, ("data",))


CASES = [("gpipe", 1, 3), ("1f1b", 1, 5), ("interleaved", 2, None), ("zb-h1", 1, 5), ("zb-v", 2, 5),
         ("dualpipev", 2, None)]
if FULL:
    CASES = [(s, v, m) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2),
                                    ("dualpipev", 2)) for m in (1, 2, 3, 4, 5, 8)]


@pytest.mark.parametrize("schedule,v,m", CASES)
def test_pipeline_matches_single_process(mpi_world, schedule, v, m):
    p = mpi_world.size
    m = m or 2 * p
    if schedule == "interleaved" and m % p:
        pytest.skip("interleaved needs n_micro % pp == 0")
    if schedule == "dualpipev" and m < 2 * p:
        pytest.skip("dualpipev needs n_micro >= 2*pp")
    cfg = config(p, v)
    model = PipelineGPT(cfg, seed=3, pp=p, rank=mpi_world.rank, v=v, dtype=np.float64,
                        placement=placement_of(schedule))
    ex = Executor(model, pp_comm(mpi_world), schedule)
    for st, _ in train_against_one_process(mpi_world, model, ex, cfg, m, 3 if not FULL else 2, seed=10):
        pass
    # the in-flight bound of each schedule (per chunk of this rank)
    if schedule == "gpipe":
        assert st["peak_in_flight"] == m
    elif schedule in ("1f1b", "zb-h1"):
        assert st["peak_in_flight"] == min(p - mpi_world.rank, m) <= p
    elif schedule == "dualpipev":             # DualPipe's PP+1: 2p+1 half-stage chunks
        assert st["peak_in_flight"] == 2 * p + 1
    assert 0.0 <= st["bubble"] < 1.0
    assert st["f_s"] > 0 and st["b_s"] > 0 and (st["w_s"] > 0) == (schedule in SPLIT_BACKWARD)
    assert st["f_s"] + st["b_s"] + st["w_s"] == pytest.approx(st["compute_s"], rel=1e-9)
    assert st["compute_s"] < st["pipeline_s"] <= st["step_s"]


@pytest.mark.ranks(lambda n: n == 2)        # on 2 cores: more ranks would time the CPU's sharing, not idling
def test_zb_h1_idles_less_than_1f1b_measured(mpi_world):
    """The executor's measured bubble (idle time over step time, per rank), on the same model and
    micro-batches in one run: zb-h1, which fills 1F1B's idle slots with deferred weight gradients,
    idles less. The closed forms at p = 2, m = 4 with B = W = F: 1F1B 1/5, zb-h1 1/13. The
    schedules alternate, three steps each after a warm-up, and each keeps its least idle step, so a
    descheduled moment does not decide it; the last rank's figures are compared (the first's
    include the wait for the last stage's backward either way)."""
    p = mpi_world.size
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=128)
    data = micro_batches(2 * p, B=4, T=32, seed=5)
    runs = {}
    for schedule in ("1f1b", "zb-h1"):
        model = PipelineGPT(cfg, seed=4, pp=p, rank=mpi_world.rank, dtype=np.float32)
        runs[schedule] = (model, Executor(model, pp_comm(mpi_world), schedule))
    best = {s: 1.0 for s in runs}
    for rep in range(4):
        for schedule, (model, ex) in runs.items():
            model.zero_grad()
            st = ex.train_step(data)
            if rep:
                best[schedule] = min(best[schedule], st["bubble"])
    every = mpi_world.allgather(best)
    assert every[-1]["zb-h1"] < every[-1]["1f1b"], every


def test_zb_h1_gradients_are_1f1bs_bitwise(mpi_world):
    """zb-h1 runs each micro-batch's weight gradients later (W), in the order 1F1B runs its
    backwards: every parameter's gradient sums the micro-batches in the same order, so the
    gradients are bitwise 1F1B's (dense and MoE blocks)."""
    p = mpi_world.size
    cfg = config(p, moe=True, capacity=1.0, n_layer=2 * p)
    grads = {}
    for schedule in ("1f1b", "zb-h1"):
        model = PipelineGPT(cfg, seed=4, pp=p, rank=mpi_world.rank, dtype=np.float32)
        ex = Executor(model, pp_comm(mpi_world), schedule)
        model.zero_grad()
        st = ex.train_step(micro_batches(2 * p + 1, seed=21))
        grads[schedule] = (st["loss"], {n: q.grad.copy() for n, q in model.named_parameters()})
    (l1, g1), (l2, g2) = grads["1f1b"], grads["zb-h1"]
    assert l1 == l2 and g1.keys() == g2.keys()
    for n in g1:
        assert np.array_equal(g1[n], g2[n]), n


@pytest.mark.parametrize("schedule,v", [("zb-h1", 1), ("zb-v", 2)])
def test_tables_for_the_measured_times(mpi_world, schedule, v):
    """Step 1 runs the unit-time table and reports every stage's F, B, W times (stage_times, this
    rank's stages only); their sum over the pipeline (one rank per stage: exact, the same array on
    every rank) gives the costs the table is built for from step 2 on, and training still equals
    one process (zb-h1: still 1F1B's gradients bit for bit, the order of the micro-batches in each
    parameter's sum does not depend on the table)."""
    p = mpi_world.size
    cfg = config(p, v)
    model = PipelineGPT(cfg, seed=3, pp=p, rank=mpi_world.rank, v=v, dtype=np.float64,
                        placement=placement_of(schedule))
    comm = pp_comm(mpi_world)
    ex = Executor(model, comm, schedule)
    for step, (st, mbs) in enumerate(train_against_one_process(mpi_world, model, ex, cfg, 2 * p + 1, 3, seed=30)):
        times = st["stage_times"]
        assert times.shape == (p * v, 3) and (times[:, 0] > 0).sum() == v      # this rank's stages
        if step == 0:
            assert st["table_costs"] is None
            ex.costs = first = measured_costs(np.asarray(comm.allreduce(times.copy())))
            assert len(first) == p * v and all(len(c) == 3 and min(c) > 0 for c in first)
            assert mpi_world.allgather(first) == [first] * p            # every rank builds the same table
        else:
            assert st["table_costs"] == first
    if schedule == "zb-h1":                                         # the same weights under 1F1B
        one = PipelineGPT(cfg, seed=3, pp=p, rank=mpi_world.rank, dtype=np.float64)
        ex1 = Executor(one, pp_comm(mpi_world), "1f1b")
        mine = dict(model.named_parameters())
        for n, q in one.named_parameters():
            q.data[...] = mine[n].data
        model.zero_grad()
        one.zero_grad()
        assert ex.train_step(mbs)["loss"] == ex1.train_step(mbs)["loss"]
        for n, q in one.named_parameters():
            assert np.array_equal(mine[n].grad, q.grad), n


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)])
def test_chunked_head_computes_its_logits_once(mpi_world, monkeypatch, schedule, v):
    """A chunked head (logits never whole: here chunks of 5 of a micro-batch's 16 rows) whose B
    is the action right after its F runs forward and backward in F's one pass: head.backward,
    which computes each chunk's logits again, never runs for such a micro-batch; the gradients
    are bitwise those of the head run apart (forward in F, backward in B), and equal one
    process's. GPipe (all F, then all B) keeps them apart."""
    import pympar.nn.gpt as gpt
    from pympar.parallel.pp.schedules import build_schedule
    monkeypatch.setattr(gpt, "CE_ROWS", 5)
    p, m = mpi_world.size, 5
    cfg = config(p, v)
    mbs = micro_batches(m, seed=31)
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(gpt.GPT, "head_fuses", lambda self, n: False)
        model = PipelineGPT(cfg, seed=3, pp=p, rank=mpi_world.rank, v=v, dtype=np.float64,
                            placement=placement_of(schedule))
        calls = {"forward_backward": 0, "backward": 0}
        for c in model.chunks:
            if c.head is not None:
                assert c.head.recomputes_logits(16)
                for name in calls:
                    def counted(*a, _f=getattr(c.head, name), _n=name, **k):
                        calls[_n] += 1
                        return _f(*a, **k)
                    monkeypatch.setattr(c.head, name, counted)
        model.zero_grad()
        st = Executor(model, pp_comm(mpi_world), schedule).train_step(mbs)
        runs[fused] = (st["loss"], {n: q.grad.copy() for n, q in model.named_parameters()}, calls, model)
    (lf, gf, cf, model), (lu, gu, cu, _) = runs[True], runs[False]
    assert lf == lu and gf.keys() == gu.keys()
    for n in gf:
        assert np.array_equal(gf[n], gu[n]), n
    head = [c for c in model.chunks if c.head is not None]
    if head:
        acts = build_schedule(schedule, p, m, v, mpi_world.rank, None)
        k = model.chunks.index(head[0])
        pairs = sum(1 for a, b in zip(acts, acts[1:]) if a.kind == "F" and a.chunk == k
                    and b.kind == "B" and b.chunk == k and b.micro == a.micro)
        assert cf == {"forward_backward": pairs, "backward": m - pairs}, (cf, pairs)
        assert cu == {"forward_backward": 0, "backward": m}
        assert pairs == {"gpipe": 0, "1f1b": m}.get(schedule, pairs) and (schedule == "gpipe") == (pairs == 0)
    ref = GPT(cfg, seed=3, dtype=np.float64)
    want = reference_step(ref, mbs)
    assert abs(lf - want) <= TOL * abs(want)
    compare(mpi_world, model, ref, ("grad",))


def test_tied_weight_gradient_summed(mpi_world):
    p = mpi_world.size
    cfg = config(p)
    model = PipelineGPT(cfg, seed=5, pp=p, rank=mpi_world.rank, dtype=np.float64)
    ex = Executor(model, pp_comm(mpi_world), "1f1b")
    mbs = micro_batches(2)
    ex.train_step(mbs)
    ref = GPT(cfg, seed=5, dtype=np.float64)
    reference_step(ref, mbs)
    # the head alone contributes this much: the sum must include it on the first stage too
    head_only = GPT(cfg, seed=5, dtype=np.float64)
    head_only.zero_grad()
    for i, t in mbs:
        ce, aux, (c_emb, ctxs, c_head) = head_only._forward(i, t)
        head_only.head.backward(1.0 / len(mbs), c_head)
    assert np.abs(head_only.embedding.wte.grad).max() > 0
    if model.tied_weight is not None:
        assert rel(model.tied_weight.grad, ref.embedding.wte.grad) <= TOL
    names = [n for n, _ in model.named_parameters(include_tied_copy=False)]
    has_wte = mpi_world.allreduce(int("transformer.wte.weight" in names))
    assert has_wte == 1, "the tied weight must be counted once over the pipeline"
    if p > 1 and mpi_world.rank in (0, p - 1):
        other = mpi_world.sendrecv(model.tied_weight.grad, dest=p - 1 - mpi_world.rank,
                                   source=p - 1 - mpi_world.rank)
        assert np.array_equal(other, model.tied_weight.grad), "first and last stage disagree on wte.grad"


@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_moe_through_pipeline(mpi_world, capacity):
    p = mpi_world.size
    cfg = config(p, moe=True, capacity=capacity)
    model = PipelineGPT(cfg, seed=7, pp=p, rank=mpi_world.rank, dtype=np.float64)
    ex = Executor(model, pp_comm(mpi_world), "1f1b")
    ref = GPT(cfg, seed=7, dtype=np.float64)
    mbs = micro_batches(3, seed=4)
    st = ex.train_step(mbs)
    want = reference_step(ref, mbs)
    assert abs(st["loss"] - want) <= TOL * abs(want)
    compare(mpi_world, model, ref, ("grad",))
    ref_stats = {s["layer"]: s for s in ref.moe_stats()}
    for s in model.moe_stats():
        np.testing.assert_array_equal(s["tokens_per_expert"], ref_stats[s["layer"]]["tokens_per_expert"])


def test_forward_loss_matches(mpi_world):
    p = mpi_world.size
    v = 2 if p * 2 <= 8 else 1
    cfg = config(p, v)
    model = PipelineGPT(cfg, seed=2, pp=p, rank=mpi_world.rank, v=v, dtype=np.float64)
    ex = Executor(model, pp_comm(mpi_world), "interleaved" if v > 1 else "1f1b")
    mbs = micro_batches(p)
    want = float(np.mean([GPT(cfg, seed=2, dtype=np.float64).forward_loss(i, t) for i, t in mbs]))
    assert abs(ex.forward_loss(mbs) - want) <= TOL * abs(want)


def test_invalid_layouts_raise_before_communication(mpi_world):
    p = mpi_world.size
    cfg = config(p, n_layer=p * 2 + 1)
    if p > 1:
        with pytest.raises(ValueError, match="divisible by pp\\*v"):
            validate_pipeline(cfg, p, n_micro=p, schedule="interleaved", v=2)
        with pytest.raises(ValueError, match="n_micro divisible by pp"):
            validate_pipeline(config(p, 2), p, n_micro=p + 1, schedule="interleaved", v=2)
        model = PipelineGPT(config(p, 2), seed=0, pp=p, rank=mpi_world.rank, v=2, dtype=np.float64)
        ex = Executor(model, pp_comm(mpi_world), "interleaved")
        with pytest.raises(ValueError, match="n_micro divisible by pp"):
            ex.train_step(micro_batches(p + 1))
    with pytest.raises(ValueError, match="cannot fill"):
        PipelineGPT(config(p, n_layer=1), pp=p + 1, rank=0)
    with pytest.raises(ValueError, match="use schedule 'interleaved'"):
        validate_pipeline(config(p, 2), p, n_micro=4, schedule="1f1b", v=2)
    mpi_world.Barrier()          # every rank got here: nothing above communicated or hung


@pytest.mark.ranks(lambda n: n >= 4 and n % 2 == 0)        # pp >= 2 and tp = 2
@pytest.mark.parametrize("sp", [False, True])
def test_pipeline_of_tensor_parallel_stages(mpi_world, sp):
    """pp x tp with tp = 2: each stage is made of tp.TPParts (TPGPT's parts), ranks
    rank = pp_rank * tp + tp_rank; every shard's grad equals the slice of the full grad."""
    from pympar.comm import MPIComm
    from pympar.parallel.shard import shard_of
    from pympar.parallel.tp import TPParts
    tp = 2
    p = mpi_world.size // tp
    world = MPIComm(mpi_world)
    tp_comm = world.split(mpi_world.rank // tp)
    pipe = world.split(mpi_world.rank % tp)
    cfg = config(p, n_layer=2 * p)
    fac = TPParts(tp_comm, dtype=np.float64, sequence_parallel=sp)
    model = PipelineGPT(cfg, seed=9, pp=p, rank=pipe.rank, factory=fac)
    ex = Executor(model, pipe, "1f1b")
    ref = GPT(cfg, seed=9, dtype=np.float64)
    mbs = micro_batches(3, seed=6)
    st = ex.train_step(mbs)
    want = reference_step(ref, mbs)
    assert abs(st["loss"] - want) <= TOL * abs(want)
    full = dict(ref.named_parameters())
    for n, prm in model.named_parameters():
        sh = shard_of(prm)
        g = full[n].grad if sh is None else sh.take(full[n].grad)
        assert rel(prm.grad, g) <= TOL, f"rank {mpi_world.rank}: grad of {n} (sp={sp}) rel {rel(prm.grad, g):.2e}"


def test_clip_grad_norm_is_the_single_process_norm(mpi_world):
    """The trainer's gradient path (GradSync over a pp mesh: the last stage's wte copy is not
    counted) gives the single-process norm and clips both wte copies alike."""
    from pympar.comm import MPIComm
    from pympar.optim import clip_grad_norm
    from pympar.parallel.gradsync import GradSync
    from pympar.parallel.mesh import Mesh
    p = mpi_world.size
    cfg = config(p)
    mesh = Mesh(MPIComm(mpi_world), pp=p)
    model = PipelineGPT(cfg, seed=4, pp=p, rank=mpi_world.rank, dtype=np.float64)
    ex = Executor(model, mesh.pp_comm, "gpipe")
    sync = GradSync(model.named_parameters(), mesh)            # the tied copy: placed by PipelineGPT
    ref = GPT(cfg, seed=4, dtype=np.float64)
    mbs = micro_batches(2)
    sync.begin_step()
    ex.train_step(mbs)
    sync.finish()
    reference_step(ref, mbs)
    total_sq = float(np.asarray(mesh.comm.allreduce(np.array([sync.local_sq()]))).reshape(-1)[0])
    norm = sync.step(sync.make_optimizer(lr=0.0, weight_decay=0.0), 0.0, 1e-3, total_sq)
    want = clip_grad_norm(ref.parameters(), 1e-3)
    assert abs(norm - want) <= TOL * want, (norm, want)
    compare(mpi_world, model, ref, ("grad",))       # both copies of wte clipped alike


def test_executor_refuses_a_raw_mpi4py_communicator(mpi_world):
    model = PipelineGPT(config(mpi_world.size), seed=3, pp=mpi_world.size, rank=mpi_world.rank)
    with pytest.raises(TypeError, match="pympar Communicator, not the mpi4py Intracomm: wrap it, pympar.comm.MPIComm"):
        PipelineExecutor(model, mpi_world)


def test_build_pipeline_and_sharded_state(mpi_world):
    from pympar.parallel.pp import build_pipeline
    p = mpi_world.size
    comm = pp_comm(mpi_world)
    cfg = config(p)
    model, ex = build_pipeline(cfg, 3, comm, schedule="1f1b", n_micro=2, dtype=np.float64, channels=CHANNELS)
    mbs = micro_batches(2)
    st = ex.train_step(mbs)
    assert abs(st["loss"] - reference_step(GPT(cfg, seed=3, dtype=np.float64), mbs)) <= 1e-10 * st["loss"]
    names = sorted(mpi_world.allgather(sorted(model.sharded_state())))
    flat = [n for part in names for n in part]
    assert sorted(flat) == sorted(n for n, _ in GPT(cfg, seed=3).named_parameters()), "every name exactly once"
    if p > 1:
        with pytest.raises(ValueError, match="n_micro divisible by pp"):
            build_pipeline(config(p, 2), 0, comm, schedule="interleaved", v=2, n_micro=p + 1)
