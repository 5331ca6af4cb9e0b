"""pympar.plan: the enumerator, the validator verdicts, the memory model against the real
models' parameter counts, the step-time model's pieces, and the CLI without --measure."""
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pympar.nn import GPT, GPTConfig
from pympar.parallel import ledger
from pympar.parallel.pp.partition import partition
from pympar.parallel.pp.schedules import bubble_formula
from pympar.nn.config import flops_per_token
from pympar.layout import Layout
from pympar.plan.cli import fit_alpha_beta, load_calibration, monotone, spearman
from pympar.plan.cost import (Machine, activations_per_micro, choose as choose_layout, enumerate_layouts, params_per_rank,
                              plan, predict)

ROOT = Path(__file__).resolve().parent.parent


def machine(**kw):
    d = dict(peak=1e10, alpha=1e-5, intra_bw=1e9, inter_bw=1e8, mem=1 << 34, act_bytes=4, mfu=0.5,
             ranks_per_node=8, overlap=0.0, overhead=0.0, cores=0)
    d.update(kw)
    return Machine(**d)


def is_expert_param(name):
    return ".moe.experts." in name


def n_params(model, keep=lambda name: True):
    return sum(p.data.size for name, p in model.named_parameters() if keep(name))


# --- the enumerator and the validators ------------------------------------------------------
@pytest.mark.parametrize("preset, world", [("small", 4), ("small", 8), ("moe-small", 8), ("tiny", 6)])
def test_every_enumerated_layout_is_valid(preset, world):
    cfg = GPTConfig.from_preset(preset)
    gb = 4 * world
    valid = [lay for lay, why in enumerate_layouts(cfg, world, gb, world) if why is None]
    assert valid
    for lay in valid:
        assert lay.dp * lay.pp * lay.cp * lay.tp == world
        assert lay.micro_batch_size * lay.n_micro * lay.dp == gb
        assert cfg.n_head % lay.tp == 0 and lay.pp <= cfg.n_layer
        etp = lay.etp if lay.folded else lay.tp           # folded experts: ep may reach over tp's ranks
        assert lay.tp % etp == 0 and (lay.dp * lay.cp * lay.tp // etp) % lay.ep == 0
        assert lay.ep == 1 or cfg.n_expert % lay.ep == 0
        assert not lay.folded or cfg.n_expert
        assert cfg.block_size % (2 * lay.cp) == 0 or lay.cp == 1
        assert not (lay.seq_parallel and lay.tp == 1) and not (lay.zero and lay.dp * lay.cp == 1)
    keys = [lay.key() for lay in valid]
    assert len(keys) == len(set(keys))


def test_enumerator_covers_the_dimensions():
    cfg = GPTConfig.from_preset("moe-small")                      # 4 layers, 4 heads, 8 experts
    valid = [lay for lay, why in enumerate_layouts(cfg, 8, 32, 8) if why is None]
    got = {(lay.dp, lay.pp, lay.tp) for lay in valid}
    assert {(8, 1, 1), (1, 8 // 2, 2), (2, 2, 2), (2, 1, 4), (1, 2, 4)} <= got
    assert {lay.ep for lay in valid} == {1, 2, 4, 8}
    assert {lay.etp for lay in valid if lay.folded} == {1, 2}        # folded apart from tp 2 and 4
    assert any(lay.ep > lay.dp * lay.cp for lay in valid)            # the case: ep over tp ranks
    assert {lay.schedule for lay in valid} == {"1f1b", "gpipe", "interleaved", "zb-h1", "zb-v", "dualpipev"}
    assert {lay.cp for lay in valid} == {1, 2, 4, 8}
    assert any(lay.zero for lay in valid) and any(lay.seq_parallel for lay in valid)


def test_rejections_say_why():
    cfg = GPTConfig.from_preset("small")                          # 4 heads
    rejected = [why for lay, why in enumerate_layouts(cfg, 8, 12, 8) if why]
    assert any("not divisible by dp=8" in w for w in rejected)    # 12 sequences over 8 DP ranks
    assert any("tp=8" in w or "n_head" in w for w in rejected)    # 4 heads over tp=8
    node = [why for lay, why in enumerate_layouts(cfg, 8, 32, ranks_per_node=2) if why]
    assert any("spans nodes" in w for w in node)


def test_out_of_memory_is_rejected_with_the_numbers():
    cfg = GPTConfig.from_preset("small")
    ok, rejected = plan(cfg, 4, 16, machine(mem=30 * 2**20, ranks_per_node=4))
    assert all(p.memory["total"] <= 30 * 2**20 for p in ok)
    oom = [why for _, why in rejected if why.startswith("out of memory")]
    assert oom and "GiB per rank" in oom[0]
    ok_big, _ = plan(cfg, 4, 16, machine(ranks_per_node=4))
    assert len(ok_big) == len(ok) + len(oom)


# --- the memory model -------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "small", "moe-tiny", "moe-small"])
def test_params_single_rank_equal_the_model(preset):
    cfg = GPTConfig.from_preset(preset)
    lay = Layout(dp=1, pp=1, tp=1, ep=1, micro_batch_size=1, n_micro=1, schedule="1f1b")
    assert params_per_rank(cfg, lay, range(cfg.n_layer), True, True) == n_params(GPT(cfg))


@pytest.mark.parametrize("ep", [2, 4])
def test_params_with_expert_parallelism(ep):
    cfg = GPTConfig.from_preset("moe-tiny")                       # 4 experts
    model = GPT(cfg)
    dense = n_params(model, lambda n: not is_expert_param(n))
    experts = n_params(model, is_expert_param)
    lay = Layout(dp=ep, pp=1, tp=1, ep=ep, micro_batch_size=1, n_micro=1, schedule="1f1b")
    assert params_per_rank(cfg, lay, range(cfg.n_layer), True, True) == dense + experts // ep


@pytest.mark.parametrize("pp", [2, 4])
def test_params_over_stages_sum_to_the_model_plus_the_tied_copy(pp):
    cfg = GPTConfig.from_preset("small")
    part = partition(cfg, pp)
    lay = Layout(dp=1, pp=pp, tp=1, ep=1, micro_batch_size=1, n_micro=4, schedule="1f1b")
    total = sum(params_per_rank(cfg, lay, part.blocks(s), s == 0, s == pp - 1) for s in range(pp))
    assert total == n_params(GPT(cfg)) + cfg.vocab_size * cfg.n_embd      # the last stage's wte copy


def test_memory_zero_stages_divide_what_they_shard():
    """The planner's memory is the ledger's (pympar.parallel.ledger.predict): ZeRO-1 divides the
    optimizer state by dp, ZeRO-2 also the persistent gradients, ZeRO-3 also the parameters."""
    cfg = GPTConfig.from_preset("gpt2-124m")         # larger than one gradient bucket
    P = 4 * params_per_rank(cfg, Layout(dp=4, pp=1, tp=1, ep=1, micro_batch_size=2, n_micro=2, schedule="1f1b"), range(cfg.n_layer), True, True)
    mem = {z: predict(cfg, Layout(dp=4, pp=1, tp=1, ep=1, micro_batch_size=2, n_micro=2, schedule="1f1b", zero=z), machine()).memory for z in range(4)}
    assert mem[0]["parameters"] == mem[1]["parameters"] == mem[2]["parameters"] == P
    assert mem[3]["parameters"] == pytest.approx(P / 4, rel=1e-3)
    assert mem[0]["optimizer"] == 2 * P                                 # AdamW m, v in float32
    for z in (1, 2, 3):
        assert mem[z]["optimizer"] == pytest.approx(2 * P / 4, rel=1e-3)
    assert mem[0]["gradients"] == mem[1]["gradients"] == P      # ZeRO-1 reduces into the full gradient
    assert mem[2]["gradients"] < mem[1]["gradients"] and mem[3]["peak"] < mem[2]["peak"] < mem[1]["peak"] < mem[0]["peak"]


def test_the_planner_takes_zero_and_recomputation_when_memory_demands_them():
    """Ample memory: no recomputation and no ZeRO-3 (both cost time); a budget that plain data
    parallelism exceeds: the fastest data-parallel layout that fits shards and/or recomputes."""
    cfg = GPTConfig.from_preset("gpt2-124m")

    def best_dp(mem):
        preds, _ = plan(cfg, 4, 4, machine(mem=mem))
        return next(p for p in preds if p.layout.tp == p.layout.pp == 1)

    roomy = best_dp(64 * 2**30).layout
    assert roomy.recompute == "none" and roomy.zero < 3, roomy
    tight = best_dp(int(1.3 * 2**30))
    assert tight.layout.zero == 3 or tight.layout.recompute != "none", tight.layout
    assert tight.memory["total"] <= 1.3 * 2**30


def test_memory_activations_follow_micro_batches_in_flight():
    cfg = GPTConfig.from_preset("small")
    m = machine()
    gpipe = predict(cfg, Layout(dp=1, pp=4, tp=1, ep=1, micro_batch_size=1, n_micro=16, schedule="gpipe"), m)
    ofob = predict(cfg, Layout(dp=1, pp=4, tp=1, ep=1, micro_batch_size=1, n_micro=16, schedule="1f1b"), m)
    assert gpipe.peak_in_flight == 16 and ofob.peak_in_flight == 4         # stage 0 of 1F1B keeps p
    # GPipe keeps all 16 on every stage, 1F1B at most p=4 (the worst ranks differ: the last stage holds logits)
    assert gpipe.memory["activations"] > 3 * ofob.memory["activations"]
    half = predict(cfg, Layout(dp=4, pp=1, tp=1, ep=1, micro_batch_size=2, n_micro=2, schedule="1f1b"), m)
    full = predict(cfg, Layout(dp=4, pp=1, tp=1, ep=1, micro_batch_size=4, n_micro=1, schedule="1f1b"), m)
    assert full.memory["activations"] > 1.9 * half.memory["activations"]
    sp = predict(cfg, Layout(dp=2, pp=1, tp=2, ep=1, micro_batch_size=8, n_micro=1, schedule="1f1b", seq_parallel=True), m)
    nosp = predict(cfg, Layout(dp=2, pp=1, tp=2, ep=1, micro_batch_size=8, n_micro=1, schedule="1f1b"), m)
    assert sp.memory["activations"] < nosp.memory["activations"]


# --- the step-time model -----------------------------------------------------------------------
@pytest.mark.parametrize("sched, p, mm, v", [("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)])
def test_bubble_without_communication_is_the_formula(sched, p, mm, v):
    cfg = GPTConfig.from_preset("small")
    pred = predict(cfg, Layout(dp=1, pp=p, tp=1, ep=1, micro_batch_size=1, n_micro=mm, schedule=sched, virtual_stages=v), machine(alpha=0.0, intra_bw=1e30))
    assert pred.bubble == pytest.approx(bubble_formula(sched, p, mm, v), rel=1e-6)


def test_oversubscribed_ranks_run_at_cores_over_ranks_and_the_bubble_is_charged():
    cfg = GPTConfig.from_preset("small")
    free = dict(alpha=0.0, intra_bw=1e30, opt_per_param=0.0)          # compute only
    lay = Layout(dp=1, pp=4, tp=1, ep=1, micro_batch_size=1, n_micro=4, schedule="gpipe")
    alone = predict(cfg, lay, machine(ranks_per_node=4, cores=0, **free))
    shared = predict(cfg, lay, machine(ranks_per_node=4, cores=2, **free))
    assert alone.time["oversubscription"] == 1.0 and shared.time["oversubscription"] == 2.0
    assert shared.step_time == pytest.approx(2 * alone.step_time, rel=1e-9)   # every rank at half a core
    # the same work as DP (4 sequences, every block once per sequence): a waiting rank keeps its
    # share of the cores, so GPipe's bubble costs its full (m + p - 1) / m
    dp = predict(cfg, Layout(dp=4, pp=1, tp=1, ep=1, micro_batch_size=1, n_micro=1, schedule="1f1b"), machine(ranks_per_node=4, cores=2, **free))
    assert shared.step_time / dp.step_time == pytest.approx((4 + 4 - 1) / 4, rel=1e-6)
    # a node with a core per rank is not slowed
    assert predict(cfg, lay, machine(ranks_per_node=4, cores=4, **free)).step_time == pytest.approx(alone.step_time)


def test_tp_pays_the_latency_of_every_allreduce():
    cfg = GPTConfig.from_preset("small")                          # 4 blocks
    m = machine(alpha=1e-3, intra_bw=1e30, ranks_per_node=4)
    for tp, nm in [(2, 1), (4, 1), (2, 4)]:
        p = predict(cfg, Layout(dp=4 // tp, pp=1, tp=tp, ep=1, micro_batch_size=2, n_micro=nm, schedule="1f1b"), m)
        # 4 per block (2 forward, 2 backward) + embedding + cross-entropy's 2, log2(tp) rounds each
        assert p.time["tp_comm"] == pytest.approx(nm * (4 * 4 + 3) * 1e-3 * math.ceil(math.log2(tp)))


def test_measured_slowdown_scales_ranks_over_cores_where_ranks_share_cores():
    cfg = GPTConfig.from_preset("small")
    free = dict(alpha=0.0, intra_bw=1e30, opt_per_param=0.0)
    lay = Layout(dp=4, pp=1, tp=1, ep=1, micro_batch_size=1, n_micro=1, schedule="1f1b")
    base = predict(cfg, lay, machine(ranks_per_node=4, cores=2, **free))
    got = predict(cfg, lay, machine(ranks_per_node=4, cores=2, slowdown=(4, 2.6), **free))
    assert got.time["oversubscription"] == 2.6 and got.step_time == pytest.approx(base.step_time * 2.6 / 2.0)
    # measured at 8 ranks on 2 cores (5.0 against 4): the same excess, 1.25, on 4 ranks' 2
    m8 = machine(ranks_per_node=4, cores=2, slowdown=(8, 5.0))
    assert m8.oversubscription(4) == pytest.approx(2.5) and m8.oversubscription(8) == pytest.approx(5.0)
    # a core per rank, or a device per rank: never slowed
    assert m8.oversubscription(2) == 1.0 and machine(cores=0, slowdown=(8, 5.0)).oversubscription(8) == 1.0


def test_arrival_spread_is_the_measured_curve():
    m = machine(arrival_curve=((1e-3, 0.2e-3), (4e-3, 1.4e-3)))
    assert m.arrival(0.0) == 0.0 and machine().arrival(1.0) == 0.0                  # no compute / no calibration
    assert m.arrival(0.5e-3) == pytest.approx(0.1e-3)                              # from 0 to the first point
    assert m.arrival(2.5e-3) == pytest.approx(0.8e-3)                              # between points
    assert m.arrival(1.0) == pytest.approx(1.4e-3)                                 # the last point beyond
    assert machine(arrival_curve=((1e-3, 0.5e-3), (1e-3, 0.7e-3))).arrival(1e-3) == 0.5e-3   # the first of equal bursts


@pytest.mark.parametrize("sp, pp, n_micro", [(False, 1, 3), (True, 1, 2), (False, 2, 4)])
def test_arrival_spread_is_charged_per_tp_collective_after_the_compute_between_two(sp, pp, n_micro):
    """Every tensor-parallel collective of every micro-batch (4 per block, 8 with sequence
    parallelism's allgather + reduce-scatter, + 3 over the stages) waits arrival(burst), burst =
    the stage's compute per micro-batch over its collectives; the step grows by as much."""
    cfg = GPTConfig.from_preset("small")                                           # 4 blocks
    flat = dict(alpha=0.0, intra_bw=1e30, ranks_per_node=8, cores=2)
    curve = ((1e-4, 0.0), (1.0, 0.5))                                              # half the burst, near enough
    lay = Layout(dp=2 // pp, pp=pp, tp=4, ep=1, micro_batch_size=2, n_micro=n_micro, schedule="1f1b",
                 seq_parallel=sp)
    base, got = (predict(cfg, lay, machine(arrival_curve=c, **flat)) for c in ((), curve))
    n = (8 if sp else 4) * 4 / pp + 3 / pp
    burst = got.time["compute"] / n_micro / n
    spread = machine(arrival_curve=curve).arrival(burst)
    assert spread > 0.4 * burst
    assert got.time["tp_comm"] - base.time["tp_comm"] == pytest.approx(n_micro * n * spread)
    if pp == 1:
        assert got.step_time - base.step_time == pytest.approx(n_micro * n * spread)
    else:
        assert got.step_time > base.step_time
    # ranks with a core each: no spread
    alone = dict(flat, cores=8)
    assert predict(cfg, lay, machine(arrival_curve=curve, **alone)).step_time == predict(cfg, lay, machine(**alone)).step_time


def test_arrival_spread_is_charged_per_expert_all_to_all_and_not_to_dp():
    cfg = GPTConfig.from_preset("small")
    flat = dict(alpha=0.0, intra_bw=1e30, ranks_per_node=4, cores=2)
    curve = ((1e-9, 1e-3), (1.0, 1e-3))                                            # 1 ms after any burst
    dp = Layout(dp=4, pp=1, tp=1, ep=1, micro_batch_size=2, n_micro=1, schedule="1f1b")
    assert predict(cfg, dp, machine(arrival_curve=curve, **flat)).step_time == predict(cfg, dp, machine(**flat)).step_time
    moe = GPTConfig.from_preset("moe-small")
    ep = Layout(dp=4, pp=1, tp=1, ep=2, micro_batch_size=2, n_micro=1, schedule="1f1b")
    n_moe = sum(1 for i in range(moe.n_layer) if moe.is_moe_block(i))
    ep_base = predict(moe, ep, machine(**flat)).time["ep_comm"]
    assert predict(moe, ep, machine(arrival_curve=curve, **flat)).time["ep_comm"] - ep_base == pytest.approx(4 * n_moe * 1e-3)


def test_monotone_is_the_least_squares_non_decreasing_fit():
    assert monotone([(1, 1.0), (2, 2.0), (3, 3.0)]) == ((1, 1.0), (2, 2.0), (3, 3.0))
    assert [y for _, y in monotone([(1, 3.0), (2, 2.0), (3, 1.0)])] == pytest.approx([2.0, 2.0, 2.0])   # pooling cascades
    got = monotone([(1, 0.2), (2, 0.5), (3, 0.1), (4, 2.0), (5, 1.0)])
    ys = [y for _, y in got]
    assert [x for x, _ in got] == [1, 2, 3, 4, 5] and ys == sorted(ys)
    assert ys == pytest.approx([0.2, 0.3, 0.3, 1.5, 1.5])                          # pooled runs take their mean
    assert sum(ys) == pytest.approx(0.2 + 0.5 + 0.1 + 2.0 + 1.0)


def test_load_calibration(tmp_path):
    cfg = GPTConfig.from_preset("small")
    one = Layout(dp=1, pp=1, tp=1, ep=1, micro_batch_size=1, n_micro=1, schedule="1f1b")
    mm = flops_per_token(cfg) * cfg.block_size
    cal = dict(preset="small", matmul_peak=1e9,
               single_process=dict(step_fixed_s=0.012, micro_fixed_s=0.006, per_seq_s=2 * mm / 1e9),
               allreduce={"4": dict(alpha_s=1e-3, busbw=2e8), "8": dict(alpha_s=3e-3, busbw=1e8)})
    f = tmp_path / "cal.json"
    f.write_text(json.dumps(cal))
    c = load_calibration(f, 8)
    assert c["peak"] == 1e9 and (c["alpha"], c["intra_bw"]) == (1e-3, 1e8)      # 3 rounds of 8 ranks
    assert c["overhead"] == pytest.approx(0.006 / (cfg.n_layer + 2))
    assert c["opt_per_param"] == pytest.approx(0.012 / params_per_rank(cfg, one, range(cfg.n_layer), True, True))
    # half of a sequence's time is matmul at the peak, the rest spread over its activation elements
    elems = activations_per_micro(cfg, one, range(cfg.n_layer), True)
    assert c["elem_time"] == pytest.approx(mm / 1e9 / elems)
    assert load_calibration(f, 5)["alpha"] == 0.5e-3               # nearest rank count: 4, 2 rounds
    # a step faster than the burst's rate: the peak rises to it and nothing is left for elem_time
    cal["single_process"]["per_seq_s"] = mm / 4e9
    f.write_text(json.dumps(cal))
    c = load_calibration(f, 4)
    assert c["peak"] == pytest.approx(4e9) and c["elem_time"] == 0.0
    assert c["arrival_curve"] == () and c["slowdown"] == ()                    # a calibration without them
    cal["arrival"] = {"4": dict(points=[[2e-3, 0.5e-3], [1e-3, 0.3e-3], [4e-3, 0.1e-3]]), "8": dict(points=[[1e-3, 2e-3]])}
    cal["contention"] = {"4": dict(slowdown=2.3)}
    f.write_text(json.dumps(cal))
    c = load_calibration(f, 4)
    assert [x for x, _ in c["arrival_curve"]] == [1e-3, 2e-3, 4e-3]                   # sorted by burst
    assert [y for _, y in c["arrival_curve"]] == pytest.approx([0.3e-3] * 3)          # made monotone
    assert c["slowdown"] == (4, 2.3)
    assert load_calibration(f, 8)["slowdown"] == (4, 2.3) and load_calibration(f, 8)["arrival_curve"] == ((1e-3, 2e-3),)
    f.write_text(json.dumps(dict(preset="small")))
    with pytest.raises(ValueError, match="not a bench/plan_calibrate.py result"):
        load_calibration(f, 4)


def test_tp_and_dp_communication_grow_with_size():
    cfg = GPTConfig.from_preset("small")
    slow = machine(intra_bw=1e8)
    tp2 = predict(cfg, Layout(dp=2, pp=1, tp=2, ep=1, micro_batch_size=8, n_micro=1, schedule="1f1b"), slow)
    tp4 = predict(cfg, Layout(dp=1, pp=1, tp=4, ep=1, micro_batch_size=16, n_micro=1, schedule="1f1b"), slow)
    assert 0 < tp2.time["tp_comm"] < tp4.time["tp_comm"]
    dp = predict(cfg, Layout(dp=4, pp=1, tp=1, ep=1, micro_batch_size=4, n_micro=1, schedule="1f1b"), slow)
    assert dp.time["dp_comm"] > 0 and tp2.time["dp_comm"] < dp.time["dp_comm"]


def test_the_planner_chooses_the_cp_attention_by_topology():
    """cp = 4, a long sequence, the network 10x slower than shared memory. Per block the ring sends
    2u k,v blocks 3cp-2 times, hidden behind compute as far as the machine overlaps; Ulysses sends
    4u twice through all-to-alls that nothing hides. Over 2 nodes of 2 ranks with the ring 3/4
    hidden, Ulysses inside each node and the ring across (a2a+ring, groups of 2) is predicted
    fastest; on one node without overlap plain Ulysses (the fewest bytes); on one node with it, the
    ring. plan() ranks the three by these times, so its first cp=4 layout is the one chosen."""
    cfg = GPTConfig(vocab_size=256, block_size=4096, n_layer=2, n_head=8, n_embd=256)
    lay = Layout(cp=4, micro_batch_size=1, n_micro=1)
    variants = {("ring", 0): lay, ("a2a", 0): replace(lay, cp_comm="a2a"),
                ("a2a+ring", 2): replace(lay, cp_comm="a2a+ring", cp_a2a=2)}

    def fastest(m):
        t = {k: predict(cfg, v, m).time["cp_comm"] for k, v in variants.items()}
        assert all(x > 0 for x in t.values()), t
        return min(t, key=t.get)
    two_nodes = machine(ranks_per_node=2, intra_bw=1e10, inter_bw=1e9, overlap=0.75)
    assert fastest(two_nodes) == ("a2a+ring", 2)
    assert fastest(machine(ranks_per_node=4, intra_bw=1e10, inter_bw=1e9, overlap=0.0)) == ("a2a", 0)
    assert fastest(machine(ranks_per_node=4, intra_bw=1e10, inter_bw=1e9, overlap=0.75)) == ("ring", 0)
    # the enumerator offers all three to plan(), which ranks them by these times
    got = {(x.cp_comm, x.cp_a2a) for x, why in enumerate_layouts(cfg, 4, 1, 2) if why is None and x.cp == 4}
    assert got == set(variants), got
    ranked = [p.layout for p in plan(cfg, 4, 1, two_nodes)[0] if p.layout.cp == 4 and p.layout.recompute == "none"]
    assert (ranked[0].cp_comm, ranked[0].cp_a2a) == ("a2a+ring", 2), [x.key() for x in ranked[:3]]


def test_fit_alpha_beta(tmp_path):
    rows = [dict(bytes=8, algo="ring", time_us=50.0, busbw=0.0), dict(bytes=8, algo="library", time_us=30.0, busbw=0.0),
            dict(bytes=1 << 20, algo="ring", time_us=1000.0, busbw=1.5), dict(bytes=1 << 22, algo="ring", time_us=3e3, busbw=2.5)]
    f = tmp_path / "a.json"
    f.write_text(json.dumps(dict(collective="allreduce", nranks=4, rows=rows)))
    assert fit_alpha_beta([f]) == (pytest.approx(30e-6), pytest.approx(2.5e9))
    g = tmp_path / "b.json"                # bench/collectives.py form: other rank counts and collectives
    g.write_text(json.dumps(dict(rows=[dict(r, collective="allreduce", nranks=8, time_us=r["time_us"] * 2,
                                            busbw=r["busbw"] / 2) for r in rows]
                                 + [dict(rows[0], collective="allgather", nranks=4, time_us=1.0)])))
    assert fit_alpha_beta([f, g], nranks=8) == (pytest.approx(60e-6), pytest.approx(1.25e9))
    assert fit_alpha_beta([f, g], nranks=4)[0] == pytest.approx(30e-6)     # allgather's 1 us is not used
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps(dict(collective="allreduce", rows=rows[:2])))
    with pytest.raises(ValueError, match=">= 1 MiB"):
        fit_alpha_beta([bad])


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254, rel=1e-6)   # ties share their mean rank


def test_choose_layout_is_a_valid_layout_of_the_world():
    for preset, world in [("small", 4), ("moe-small", 8), ("tiny", 3)]:
        lay = choose_layout(GPTConfig.from_preset(preset), world, 4 * world)
        assert lay.dp * lay.pp * lay.tp == world and lay.micro_batch_size * lay.n_micro * lay.dp == 4 * world
    with pytest.raises(ValueError, match="no valid layout"):
        choose_layout(GPTConfig.from_preset("small"), 4, 16, mem_per_rank=1024)


# --- the CLI (no --measure) -------------------------------------------------------------------
def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pympar.plan", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_cli_table_and_json(tmp_path):
    out = tmp_path / "plan.json"
    r = run_cli("--preset", "small", "--world", "4", "--peak-flops", "1e10", "--top", "5", "--json", str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "world 4" in lines[0] and "step(ms)" in lines[1]
    assert [l.split()[0] for l in lines[3:8]] == ["1", "2", "3", "4", "5"]
    d = json.loads(out.read_text())
    times = [c["step_time_s"] for c in d["candidates"]]
    assert times == sorted(times) and len(times) > 20
    assert d["rejected"] and all(x["reason"] for x in d["rejected"])


def test_cli_gpu_device_and_errors():
    r = run_cli("--preset", "gpt2-124m", "--world", "64", "--ranks-per-node", "2", "--device", "h100",
                "--global-batch", "512", "--top", "3")
    assert r.returncode == 0, r.stderr
    assert "device h100" in r.stdout and "spans nodes" in r.stdout        # tp=4 leaves a node of 2
    bad = run_cli("--preset", "small", "--world", "0")
    assert bad.returncode == 2 and "--world=0 must be >= 1" in bad.stderr
    bad = run_cli("--preset", "nope", "--world", "2")
    assert bad.returncode == 2 and "unknown preset" in bad.stderr


def test_cli_refuses_bad_numbers_and_files_in_one_line(tmp_path):
    """Every bad number or file: one "error:" line, status 2, no traceback (they were tracebacks,
    negative step times or silent defaults)."""
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "summary.json").write_text('{"steps": 3}')
    cases = {("--peak-flops", "-5"): "--peak-flops=-5.0 must be a positive number",
             ("--overlap", "5"): "--overlap=5.0 must be in 0..1",
             ("--mem-per-rank=-1GiB",): "must be a positive size",
             ("--mem-per-rank", "banana"): "--mem-per-rank 'banana'",
             ("--global-batch", "0"): "--global-batch=0 must be >= 1",
             ("--ranks-per-node", "0"): "--ranks-per-node=0 must be >= 1",
             ("--top", "-1"): "--top=-1 must be >= 0",
             ("--json", str(tmp_path)): "is a directory",
             ("--json", str(tmp_path / "no" / "x.json")): "not a writable directory",
             ("--bench-json", str(tmp_path / "missing.json")): "No such file",
             ("--bench-json", str(tmp_path / "summary.json")): "not a pympar.bench --json result",
             ("--calibration", str(tmp_path / "bad.json")): "not a JSON file",
             ("--calibration", str(tmp_path)): "Is a directory",
             ("--device", "h100", "--calibration", str(tmp_path / "bad.json")): "does not apply to --device h100"}
    for args, want in cases.items():
        r = run_cli("--preset", "tiny", "--world", "2", *args)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-500:])


@pytest.mark.mpi
def test_cli_measure_runs_the_top_layouts(tmp_path):
    """--measure trains the top candidates with the real trainer (it failed on an import before)."""
    r = run_cli("--preset", "tiny", "--world", "2", "--measure", "1", "--measure-steps", "2", "--top", "1",
                "--json", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "p.json").read_text())["measured"]
    assert len(rows) == 1 and rows[0]["measured_s"] > 0, rows


def test_context_parallel_layouts_split_a_long_sequence():
    """One sequence of 32k positions on 4 ranks: the planner's ledger holds T/cp positions per rank
    (activations 1/cp, ring buffers under communication), and when only cp=4 fits the memory
    sequence the plan keeps the cp layouts and rejects the others for memory."""
    cfg = GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=32768, vocab_size=256).validate()
    one, _ = ledger.predict(cfg, tiled=True)
    four, _ = ledger.predict(cfg, cp=4, tiled=True)
    assert four["activations"] == pytest.approx(one["activations"] / 4, rel=1e-3)
    assert four["communication"] >= ledger.cp_bytes(1, 32768 // 4, 128, 4, 4) > 0
    # Ulysses' buffers (6 units of 1 x 8192 x 128 x 4 bytes) against the ring's 5 blocks at cp 4
    a2a, _ = ledger.predict(cfg, cp=4, tiled=True, cp_comm="a2a")
    hyb, _ = ledger.predict(cfg, cp=4, tiled=True, cp_comm="a2a+ring", cp_a2a=2)
    unit = 8192 * 128 * 4
    assert four["communication"] - a2a["communication"] == (10 - 6) * unit
    assert hyb["communication"] - a2a["communication"] == (10 - 6) * unit   # 4 + the ring of 2's 3 blocks
    every, _ = plan(cfg, 4, 1, machine(mem=1 << 50))
    need = lambda preds: min(p.memory["total"] for p in preds)       # noqa: E731
    cp4, others = need([p for p in every if p.layout.cp == 4]), need([p for p in every if p.layout.cp != 4])
    assert cp4 < others                                 # splitting the sequence 4 ways is the leanest
    ok, rejected = plan(cfg, 4, 1, machine(mem=(cp4 + others) / 2))  # a memory only cp=4 fits in
    assert ok and all(p.layout.cp == 4 for p in ok)
    assert any(k.startswith("dp1 pp1 tp4 ep1 mbs1") and "out of memory" in why for k, why in rejected)
    assert ok[0].time["cp_comm"] > 0 and ok[0].layout.train_args()[8:10] == ["--cp", "4"]
