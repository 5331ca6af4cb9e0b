"""Pipeline parallelism: schedule properties (pure Python) and the MPI equivalence tests.

The MPI part (tests/mpi/mpi_pp.py) runs the world as one pipeline and compares every stage
with the single-process nn.GPT doing gradient accumulation over the same micro-batches.
"""
import itertools
import sys

import pytest

from mpirun import run_pytest_mpi
from pympar.nn import GPTConfig
from pympar.parallel.pp import (SCHEDULES, Action, bubble_formula, build_schedule, partition,
                                peak_in_flight, simulate, validate_pipeline, validate_schedule)
from pympar.parallel.pp.schedules import (SPLIT_BACKWARD, compiled_table, peak_held, placement_of, rank_of,
                                          stage_of)

GRID = [(s, p, m, v) for s in SCHEDULES for p in range(1, 5) for m in range(1, 9) for v in (1, 2)]


def valid(s, p, m, v):
    try:
        validate_schedule(s, p, m, v)
        return True
    except ValueError:
        return False


VALID = [g for g in GRID if valid(*g)]


def test_grid_has_every_schedule():
    assert {s for s, *_ in VALID} == set(SCHEDULES)
    assert any(s == "interleaved" and v == 2 for s, p, m, v in VALID)


@pytest.mark.parametrize("s,p,m,v", VALID)
def test_schedule_properties(s, p, m, v):
    sch = [build_schedule(s, p, m, v, r) for r in range(p)]
    kinds = "FBW" if s in SPLIT_BACKWARD else "FB"
    for r, acts in enumerate(sch):
        # every (micro, chunk) exactly one F and one B (and one W), in that order
        want = {(k, j, c) for k in kinds for j in range(m) for c in range(v)}
        got = [(a.kind, a.micro, a.chunk) for a in acts]
        assert len(got) == len(want) and set(got) == want, (r, acts)
        for j, c in itertools.product(range(m), range(v)):
            assert got.index(("F", j, c)) < got.index(("B", j, c)), (r, j, c)
            if "W" in kinds:
                assert got.index(("B", j, c)) < got.index(("W", j, c)), (r, j, c)
    # dependencies across ranks are satisfiable (simulate raises on a deadlock) and with
    # backward = 2 x forward (B = W = forward when split) the idle time is the textbook bubble
    res = simulate(sch, p, v, f_cost=1.0, b_cost=2.0, w_cost=1.0, placement=placement_of(s))
    one = simulate([build_schedule("1f1b", p, m, 1, r) for r in range(p)], p, 1, 1.0, 2.0)
    if s == "zb-v":                           # the paper's ideal is 0; the list schedule's is below zb-h1's
        zb = simulate([build_schedule("zb-h1", p, m, 1, r) for r in range(p)], p, 1, 1.0, 2.0, w_cost=1.0)
        assert max(res["bubble"]) <= max(zb["bubble"]) + 1e-12 and max(res["bubble"]) <= max(one["bubble"])
    elif s == "dualpipev":                    # p-1 half-stage F+B-W per rank; below zb-v's list table
        zv = simulate([build_schedule("zb-v", p, m, 2, r) for r in range(p)], p, 2, 1.0, 2.0, w_cost=1.0,
                      placement="v")
        assert max(res["bubble"]) == pytest.approx(bubble_formula(s, p, m, v), abs=1e-12)
        assert max(res["bubble"]) <= max(zv["bubble"]) + 1e-12
    elif s == "zb-h1" and m < p:              # the formula assumes a steady state (m >= p)
        assert max(res["bubble"]) <= max(one["bubble"]) + 1e-12
    else:
        assert max(res["bubble"]) == pytest.approx(bubble_formula(s, p, m, v), abs=1e-12)
    peaks = [peak_in_flight(a) for a in sch]
    if s == "zb-v":                           # 2p half-stage chunks: p stages, 1F1B's first-stage bound
        assert max(peaks) <= 2 * p and all(_most_between(a, "F", "W") <= 4 * p - 1 for a in sch)
    elif s == "dualpipev":                    # DualPipe's PP+1: 2p+1 half-stage chunks on every rank
        assert peaks == [2 * p + 1] * p
    elif s == "zb-h1":                        # 1F1B's bound between F and B; W's deferred at most p-r-1
        assert peaks == [min(p - r, m) for r in range(p)]
        for r, acts in enumerate(sch):
            assert _most_between(acts, "F", "W") <= 2 * p - r - 1
    elif s == "gpipe":
        assert peaks == [m] * p
    elif v == 1:                             # 1f1b, and interleaved with one chunk is 1f1b
        assert peaks == [min(p - r, m) for r in range(p)] and max(peaks) <= p
    else:                                    # interleaved: Megatron's warm-up depth + 1
        assert peaks == [min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) for r in range(p)]


def _most_between(acts, first, last):
    """Most micro-batches whose ``first`` action ran and ``last`` did not, over the list."""
    n = most = 0
    for a in acts:
        n += (a.kind == first) - (a.kind == last)
        most = max(most, n)
    return most


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h1_tables_for_every_depth(p):
    """ZB-H1 for p = 2..8 and m = 1..16: each table valid (F < B < W per micro-batch, the
    pipeline dependencies satisfiable), 1F1B's in-flight bound, and its bubble: with F = B = W
    a third of 1F1B's (the paper's (p-1)(F+B-W) of idle time) once m >= p, and never more than
    1F1B's; with W a third of B+W the same formula with those times."""
    for m in range(1, 17):
        sch = [build_schedule("zb-h1", p, m, 1, r) for r in range(p)]
        for r, acts in enumerate(sch):
            assert _most_between(acts, "F", "B") <= min(p - r, m)
            assert [a.micro for a in acts if a.kind == "W"] == list(range(m))
        zb = max(simulate(sch, p, 1, 1.0, 2.0, w_cost=1.0)["bubble"])
        one = max(simulate([build_schedule("1f1b", p, m, 1, r) for r in range(p)], p, 1, 1.0, 2.0)["bubble"])
        assert zb <= one + 1e-12
        if m >= p:
            assert zb == pytest.approx(bubble_formula("zb-h1", p, m), abs=1e-12)
            assert zb == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
            idle_zb, idle_one = zb * (3 * m + p - 1), one * (3 * m + 3 * (p - 1))   # in units of F
            assert idle_zb == pytest.approx(idle_one / 3)


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_v_tables_for_every_depth(p):
    """ZB-V for p = 2..8, m = 1..16: valid tables in the V placement (rank r: stages r, 2p-1-r), at
    most 2p chunk micro-batches between F and B (1F1B's memory), and a bubble below zb-h1's; at
    p = 2, m = 8 with F = B = W it is 0.18 x 1F1B's (target <= 0.35)."""
    for m in range(1, 17):
        sch = [build_schedule("zb-v", p, m, 2, r) for r in range(p)]
        for r, acts in enumerate(sch):
            assert _most_between(acts, "F", "B") <= 2 * p
            for c in (0, 1):
                assert [a.micro for a in acts if a.kind == "W" and a.chunk == c] == list(range(m))
        zv = max(simulate(sch, p, 2, 1.0, 2.0, w_cost=1.0, placement="v")["bubble"])
        zh = max(simulate([build_schedule("zb-h1", p, m, 1, r) for r in range(p)], p, 1, 1.0, 2.0, w_cost=1.0)["bubble"])
        assert zv <= zh + 1e-12
    one = max(simulate([build_schedule("1f1b", 2, 8, 1, r) for r in range(2)], 2, 1, 1.0, 2.0)["bubble"])
    zv = max(simulate([build_schedule("zb-v", 2, 8, 2, r) for r in range(2)], 2, 2, 1.0, 2.0, w_cost=1.0,
                      placement="v")["bubble"])
    assert zv / one == pytest.approx(0.18, abs=0.01)


@pytest.mark.parametrize("p", range(2, 9))
def test_dualpipev_tables_for_every_depth(p):
    """DualPipeV for p = 2..8, m = 2p..4p: every chunk's F, B and W once and in micro-batch order, a
    B that is not split followed by its own W at once, 2p+1 chunk micro-batches held (DualPipe's
    PP+1), and the bubble: the formula's with F = B = W and whenever B <= F, never above it by more
    than (p-1)(B-F) chunk-times when B > F, and (B <= F) not above the zb-v table built for the same
    times (with B > F that table can be the shorter one)."""
    for m in range(2 * p, 4 * p + 1):
        sch = [build_schedule("dualpipev", p, m, 2, r) for r in range(p)]
        for acts in sch:
            for c, k in itertools.product((0, 1), "FBW"):
                assert [a.micro for a in acts if a.kind == k and a.chunk == c] == list(range(m))
            assert peak_held(acts) == 2 * p + 1
        for f, b, w in ((1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 0.5, 0.5), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0)):
            res = simulate(sch, p, 2, f, b + w, w_cost=w, placement="v")
            idle = res["makespan"] - res["busy"][0]
            want = (p - 1) * (f + b - w) / 2                       # per chunk: half a stage's times
            if b <= f:
                assert idle == pytest.approx(want, abs=1e-9), (m, f, b, w)
            else:
                assert want - 1e-9 <= idle <= want + (p - 1) * (b - f) / 2 + 1e-9, (m, f, b, w, idle)
            costs = ((f, b, w),) * (2 * p)
            zv = simulate([build_schedule("zb-v", p, m, 2, r, costs) for r in range(p)], p, 2, f, b + w, w_cost=w,
                          placement="v")
            if b <= f:                # with B > F the zb-v table built for those times can be shorter
                assert res["makespan"] <= zv["makespan"] + 1e-9, (m, f, b, w)


def _runs_to_the_end(tables, p, pairs_of):
    """Does every rank reach the end of its table when the actions pairs_of(table) names run as one unit
    (both inputs received first, both outputs sent after both, as the executor runs an overlapped pair)?
    Stages in the V (chunk 0 is stage r, chunk 1 stage 2p-1-r); each rank takes its next unit when
    every input of it has been sent."""
    S = 2 * p
    stage = [[r, S - 1 - r] for r in range(p)]
    units = []
    for r, acts in enumerate(tables):
        pr, u, i = pairs_of(acts), [], 0
        while i < len(acts):
            n = 2 if i in pr else 1
            u.append(acts[i:i + n])
            i += n
        units.append(u)
    done, pos = set(), [0] * p

    def ready(r, a):
        s = stage[r][a.chunk]
        if a.kind == "F":
            return s == 0 or ("F", a.micro, s - 1) in done
        if a.kind == "B":
            return ("F", a.micro, s) in done and (s == S - 1 or ("B", a.micro, s + 1) in done)
        return ("B", a.micro, s) in done

    moved = True
    while moved:
        moved = False
        for r in range(p):
            if pos[r] < len(units[r]) and all(ready(r, a) for a in units[r][pos[r]]):
                done.update((a.kind, a.micro, stage[r][a.chunk]) for a in units[r][pos[r]])
                pos[r] += 1
                moved = True
    return pos == [len(u) for u in units]


@pytest.mark.parametrize("p", range(2, 9))
def test_dualpipev_pairs_never_wait_on_each_other(p):
    """The executor's overlapped pairs (overlap_pairs: each F followed by a B of the other chunk,
    DualPipeV's phases 4 and 5) wait for both inputs before either runs and send both outputs after
    both: no B of a pair may need what its F sends. Every rank runs to the end at m = 2p..4p, with
    the pairs DeepSeek's table places; zb-v's table with every F paired with the B after it (on the
    turn of the V, a micro-batch's B needs the F before it) does not, so the check can fail."""
    from pympar.parallel.pp.schedules import overlap_pairs
    for m in range(2 * p, 4 * p + 1):
        sch = [build_schedule("dualpipev", p, m, 2, r) for r in range(p)]
        assert all(overlap_pairs(acts) for acts in sch), m          # every rank has pairs to overlap
        for acts in sch:
            for i in overlap_pairs(acts):
                f, b = acts[i], acts[i + 1]
                assert (f.kind, b.kind) == ("F", "B") and f.chunk != b.chunk
        assert _runs_to_the_end(sch, p, overlap_pairs), m
        assert _runs_to_the_end(sch, p, lambda acts: set()), m       # the table itself, one action at a time
    zbv = [build_schedule("zb-v", p, 4 * p, 2, r) for r in range(p)]
    greedy = lambda acts: {i for i in range(len(acts) - 1) if acts[i].kind == "F" and acts[i + 1].kind == "B"}
    assert not _runs_to_the_end(zbv, p, greedy)


@pytest.mark.parametrize("s", ["zb-h1", "zb-v"])
def test_split_tables_for_measured_costs(s):
    """Tables built for unequal (F, B, W) per stage (PipelineExecutor costs="measured"): for
    random costs at p = 2..4, m = 1..8 every table is valid (F < B < W per micro-batch and chunk,
    W's in micro-batch order, the pipeline's dependencies satisfiable), keeps the unit table's
    memory bounds, and carries each channel's messages in the order the receiver consumes them."""
    import random

    rnd = random.Random(5)
    v = 2 if s == "zb-v" else 1
    for p in range(2, 5):
        for m in range(1, 9):
            costs = tuple(tuple(rnd.choice((0.5, 0.75, 1.0, 1.25, 2.0)) for _ in "FBW") for _ in range(p * v))
            sch = [build_schedule(s, p, m, v, r, costs) for r in range(p)]
            for r, acts in enumerate(sch):
                got = [(a.kind, a.micro, a.chunk) for a in acts]
                assert sorted(got) == sorted((k, j, c) for k in "FBW" for j in range(m) for c in range(v))
                for j, c in itertools.product(range(m), range(v)):
                    assert got.index(("F", j, c)) < got.index(("B", j, c)) < got.index(("W", j, c))
                for c in range(v):
                    assert [a.micro for a in acts if a.kind == "W" and a.chunk == c] == list(range(m))
                bound = 2 * p if v == 2 else min(p - r, m)
                assert _most_between(acts, "F", "B") <= bound
                assert _most_between(acts, "F", "W") <= (4 * p - 1 if v == 2 else 2 * p - r - 1)
            simulate(sch, p, v, 1.0, 2.0, w_cost=1.0, placement=placement_of(s))      # raises on a deadlock
            sends, recvs = _channel_traffic(s, p, m, v, costs)
            assert sends == recvs, (p, m, costs)


def test_tables_for_the_measured_times_shrink_the_bubble():
    """With the F, B, W times measured on 2 ranks of real blocks (6.9, 7.0, 5.8 ms per micro-batch
    and stage, docs/pipeline.md), on the discrete-event model with those times: zb-h1's table idles
    exactly its closed form (Qi et al., with those f, b, w) whichever table it is built from, and the
    zb-v table built for the measured times idles less than the unit-time one (by at least a quarter
    at m = 8 and 16) and less than zb-h1. Costs that are not one positive triple per stage are
    refused."""
    from pympar.parallel.pp.schedules import measured_costs

    f, b, w = 6.9, 7.0, 5.8
    for m in (8, 16):
        got = {}
        for s, v in (("zb-h1", 1), ("zb-v", 2)):
            costs = ((f / v, b / v, w / v),) * (2 * v)
            for name, c in (("unit", None), ("measured", costs)):
                sch = [build_schedule(s, 2, m, v, r, c) for r in range(2)]
                got[s, name] = max(simulate(sch, 2, v, f_cost=f, b_cost=b + w, w_cost=w,
                                            placement=placement_of(s))["bubble"])
        closed = bubble_formula("zb-h1", 2, m, f=f, b=b, w=w)
        assert got["zb-h1", "unit"] == pytest.approx(closed, abs=1e-12), (m, got, closed)
        assert got["zb-h1", "measured"] == pytest.approx(closed, abs=1e-12), (m, got, closed)
        assert got["zb-v", "measured"] <= 0.75 * got["zb-v", "unit"], (m, got)
        assert got["zb-v", "measured"] < got["zb-h1", "measured"], (m, got)
    # the executor's quantisation: eighths of the mean F, the same for times within 1/16 of it
    assert measured_costs([[6.9, 7.0, 5.8], [7.1, 7.3, 5.9]]) == ((1.0, 1.0, 0.875), (1.0, 1.0, 0.875))
    assert measured_costs([[1e-3, 2e-3, 1e-6]]) == ((1.0, 2.0, 0.125),)        # at least 1/8
    with pytest.raises(ValueError, match="costs must be 4 .F, B, W. triples of positive times"):
        build_schedule("zb-v", 2, 4, 2, 0, ((1.0, 1.0, 1.0),) * 3)
    with pytest.raises(ValueError, match="positive"):
        build_schedule("zb-h1", 2, 4, 1, 0, ((1.0, 0.0, 1.0), (1.0, 1.0, 1.0)))


def test_v_placement_and_its_partition():
    assert [stage_of(r, c, 4, "v") for r in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(rank_of(stage_of(r, c, 4, "v"), 4, "v") == (r, c) for r in range(4) for c in (0, 1))
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=5, n_head=2, n_embd=16)
    part = validate_pipeline(cfg, 2, 4, "zb-v", 2)            # any n_layer >= 2p: a contiguous cut
    assert part.placement == "v" and part.stages_of(0) == [0, 3] and part.stages_of(1) == [1, 2]
    assert sum(len(part.blocks(s)) for s in range(4)) == 5
    with pytest.raises(ValueError, match=r"zb-v places 2 chunks per rank .* use n_layer >= 6, pp <= 2 or another schedule \(zb-h1\)"):
        validate_pipeline(cfg, 3, 4, "zb-v", 2)
    with pytest.raises(ValueError, match=r"n_layer=5: use n_layer >= 8, pp <= 2 or another schedule \(1f1b\)"):
        validate_pipeline(cfg, 4, 8, "dualpipev", 2)
    with pytest.raises(ValueError, match=r"n_layer=2: use n_layer >= 4 or another schedule \(1f1b\)"):  # no pp <= 1
        validate_pipeline(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16), 2, 4, "dualpipev", 2)


def test_simulate_detects_deadlock():
    # rank 1 wants micro-batch 1 before 0, rank 0 sends 0 first and waits for 0's gradient
    sch = [[Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)],
           [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]]
    res = simulate(sch, 2)                   # fine: sends never block in the executor
    assert res["makespan"] > 0
    bad = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad, 2)


@pytest.mark.parametrize("args,msg", [
    (("zb", 2, 4, 1), "unknown pipeline schedule"),
    (("zb-h1", 2, 4, 2), "use schedule 'interleaved'"),
    (("zb-v", 2, 4, 1), "zb-v runs two model chunks per rank"),
    (("dualpipev", 2, 4, 1), "dualpipev runs two model chunks per rank"),
    (("dualpipev", 3, 5, 2), "dualpipev needs n_micro >= 2\\*pp"),
    (("1f1b", 2, 4, 2), "use schedule 'interleaved'"),
    (("interleaved", 4, 6, 2), "n_micro divisible by pp"),
    (("gpipe", 0, 4, 1), "pp=0"),
    (("gpipe", 2, 0, 1), "n_micro=0"),
])
def test_invalid_schedules(args, msg):
    with pytest.raises(ValueError, match=msg):
        validate_schedule(*args)


def test_partition_balances_cost():
    c = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    part = partition(c, 4)
    assert part.bounds[0] == 0 and part.bounds[-1] == 12
    assert all(part.bounds[i] < part.bounds[i + 1] for i in range(4))
    # the head (2*C*V per token) is worth several blocks: the last stage gets fewer blocks
    sizes = [len(part.blocks(s)) for s in range(4)]
    assert sizes[-1] < sizes[1], sizes
    # no contiguous cut has a lower maximum stage cost
    best = min(max(sum(x) for x in _costs(c, cut)) for cut in itertools.combinations(range(1, 12), 3))
    assert max(part.costs) == pytest.approx(best)


def _costs(c, cut):
    from pympar.parallel.pp.partition import block_flops, embedding_flops, head_flops
    b = (0,) + cut + (c.n_layer,)
    out = [[block_flops(c, i) for i in range(b[s], b[s + 1])] for s in range(len(b) - 1)]
    out[0].append(embedding_flops(c))
    out[-1].append(head_flops(c))
    return out


def test_partition_interleaved_and_moe():
    c = GPTConfig(n_layer=8, n_expert=4, moe_every=2)
    part = partition(c, 2, 2)
    assert part.bounds == (0, 2, 4, 6, 8) and part.stages_of(1) == [1, 3]
    with pytest.raises(ValueError, match="divisible by pp\\*v"):
        partition(GPTConfig(n_layer=6), 2, 2)
    with pytest.raises(ValueError, match="cannot fill"):
        validate_pipeline(GPTConfig(n_layer=2), 3, 3)


def test_validate_pipeline_rejects_micro_batches_beyond_the_tag_space():
    c = GPTConfig(n_layer=4)
    validate_pipeline(c, 2, 16383)                      # tags up to 32765: below the tied weight's 32767
    with pytest.raises(ValueError, match="n_micro=16384 x v=1 = 16384 .* reaches the tied-weight tag 32767.*<= 16383"):
        validate_pipeline(c, 2, 16384)
    with pytest.raises(ValueError, match="n_micro=8192 x v=2"):
        validate_pipeline(c, 2, 8192, "interleaved", v=2)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_mpi(n):
    run_pytest_mpi(n, "mpi_pp.py", timeout=60 + 15 * n)


def _channel_traffic(s, p, m, v, costs=None):
    """Per (sender, receiver, kind) channel: the (micro, chunk) of each message in the order the
    sender issues it, and in the order the receiver consumes it (the executor's loops)."""
    from pympar.parallel.pp.channels import channel_edges
    from pympar.parallel.pp.schedules import rank_of, stage_of

    sends, recvs, n_stage, pl = {}, {}, p * v, placement_of(s)
    for r in range(p):
        for a in build_schedule(s, p, m, v, r, costs):
            st = stage_of(r, a.chunk, p, pl)
            nxt, prv = (rank_of(st + 1, p, pl) if st < n_stage - 1 else None), (rank_of(st - 1, p, pl) if st else None)
            if a.kind == "F" and nxt:
                sends.setdefault((r, nxt[0], "F"), []).append((a.micro, nxt[1]))
            if a.kind == "F" and prv:
                recvs.setdefault((prv[0], r, "F"), []).append((a.micro, a.chunk))
            if a.kind == "B" and prv:
                sends.setdefault((r, prv[0], "B"), []).append((a.micro, prv[1]))
            if a.kind == "B" and nxt:
                recvs.setdefault((nxt[0], r, "B"), []).append((a.micro, a.chunk))
    edges = set(channel_edges(p, v, pl))
    assert all(k in edges or k[0] == k[1] for k in sends), (s, p, v)   # a channel, or the rank itself
    return sends, recvs


@pytest.mark.parametrize("s,p,m,v", [g for g in VALID if g[1] > 1])
def test_channels_carry_messages_in_consumption_order(s, p, m, v):
    """What makes tagless (NCCL) pipeline channels correct: on each one-direction, one-kind
    channel the sender's order is the receiver's order, for every schedule."""
    sends, recvs = _channel_traffic(s, p, m, v)
    assert sends == recvs


def test_channel_check_catches_a_reordered_schedule(monkeypatch):
    import pympar.parallel.pp.schedules as sch

    real = sch.build_schedule

    def swapped(s, p, m, v, r, costs=None):   # rank 1 runs its first two backwards swapped
        acts = list(real(s, p, m, v, r, costs))
        if r == 1:
            i, j = [k for k, a in enumerate(acts) if a.kind == "B"][:2]
            acts[i], acts[j] = acts[j], acts[i]
        return acts

    monkeypatch.setattr(sys.modules[__name__], "build_schedule", swapped)
    sends, recvs = _channel_traffic("gpipe", 2, 3, 1)
    assert sends != recvs


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_mpi_over_ordered_channels(n):
    """The executor with ordered two-rank channels and no tags (what it uses on NCCL), over MPI:
    a message in the wrong order lands in the wrong buffer and the comparisons fail."""
    run_pytest_mpi(n, "mpi_pp.py", timeout=60 + 15 * n, env={"PYMPAR_PP_CHANNELS": "1"})


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_pipeline_mpi_full_matrix(n):
    run_pytest_mpi(n, "mpi_pp.py", timeout=120 + 60 * n, env={"PYMPAR_PP_FULL": "1"})


def test_a_compiled_table_simulates_as_its_lists_and_the_tables_are_fresh_lists():
    """The planner simulates schedules.compiled_table (kept per schedule, p, m, v) where the
    executor's tests pass lists: the same makespan, busy times and bubbles for any costs; and
    build_schedule hands out a new list each time (its cached table must not be changed through it)."""
    import random
    rng = random.Random(0)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)):
        for p, m in ((2, 4), (3, 6), (4, 8)):
            lists = [build_schedule(name, p, m, v, r) for r in range(p)]
            for _ in range(3):
                f, b, c = rng.uniform(0.1, 1), rng.uniform(0.1, 2), rng.uniform(0, 0.5)
                w = rng.choice([None, b * rng.random()])
                assert simulate(compiled_table(name, p, m, v), p, v, f, b, c, w) == \
                    simulate(lists, p, v, f, b, c, w, placement=placement_of(name)), (name, p, m)
    a = build_schedule("1f1b", 2, 4, 1, 0)
    a.clear()
    assert len(build_schedule("1f1b", 2, 4, 1, 0)) == 8


@pytest.mark.parametrize("name, p, m, v, f, b, c, w, makespan, busy", [
    ("1f1b", 4, 8, 1, 1.0, 2.0, 0.25, None, 37.0, 24.0),
    ("zb-h1", 3, 6, 1, 0.5, 1.5, 0.1, 0.6, 14.4, 12.0),
    ("zb-v", 2, 8, 2, 1.0, 2.0, 0.0, 1.0, 24.5, 24.0),
    ("dualpipev", 4, 16, 2, 0.7, 1.9, 0.3, 0.8, 47.95, 41.6),
    ("interleaved", 2, 4, 2, 1.0, 2.0, 0.5, None, 16.5, 12.0),
    ("gpipe", 3, 4, 1, 1.0, 3.0, 0.2, None, 24.8, 16.0)])
def test_simulate_gives_what_the_event_model_gave_before_it_was_compiled(name, p, m, v, f, b, c, w, makespan, busy):
    """Makespans and busy times of the discrete-event model as it was before simulate ran on compiled
    tables (the planner's pipeline times): a change in what it computes, not only in its form, fails."""
    res = simulate(compiled_table(name, p, m, v), p, v, f, b, c, w)
    assert res["makespan"] == pytest.approx(makespan, rel=1e-12)
    assert res["busy"] == pytest.approx([busy] * p, rel=1e-12)
