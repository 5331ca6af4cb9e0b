"""Pipeline schedules as explicit per-rank action lists, plus a simulator that checks them.

A schedule is, for each pipeline rank, an ordered list of ``Action(kind, micro, chunk)``:
``kind`` is "F" (forward), "B" (backward; in the zero-bubble schedules only its input gradient)
or "W" (the weight gradients a "B" deferred), ``micro`` the micro-batch (0..m-1) and ``chunk``
the rank's local model chunk (0..v-1). With v chunks per rank the model has S = p*v stages and
rank r holds the global stages r, r+p, r+2p, ... (Megatron's interleaved assignment), so
local chunk c of rank r is global stage ``c*p + r``.

Dependencies (what the executor waits for): F(j, s) needs F(j, s-1)'s activation; B(j, s)
needs F(j, s) on the same rank and B(j, s+1)'s gradient (the last stage starts backward from
its own loss); W(j, s) needs B(j, s) on the same rank and nothing from the others. The executor posts receives early and sends without blocking, so a schedule
runs without deadlock exactly when ``simulate`` finishes it.

  gpipe        all m forwards, then all m backwards          peak in flight m
  1f1b         PipeDream-flush: p-r-1 warm-up forwards, then alternate one F one B
               and drain                                      peak in flight min(p-r, m) <= p
  interleaved  1F1B over m*v virtual micro-batches, v chunks per rank (needs m % p == 0);
               bubble (p-1)/(v*m+p-1) instead of (p-1)/(m+p-1)
  zb-h1        zero bubble, 1F1B's activation memory (Qi et al., ICLR 2024): backward split into
               B and W; at most p-r micro-batches between F and B on rank r, as 1F1B; the W
               passes fill the slots where 1F1B waits (above all the drain, where B's now travel
               up the pipeline at the B pass's pace), at most p-r-1 of them deferred. The table is the list schedule of unit-time
               F, B, W (``list_schedule``: at each moment the earliest action, B before F before
               W on ties): bubble (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)), a third of 1F1B's when
               F = B = W
  zb-v         ZB-V: two chunks per rank placed in a V (rank r holds stages r and 2p-1-r) and the
               same list schedule over them, at 1F1B's activation memory (2p half-stage chunks);
               zero bubble in the paper's ideal timing, and 1-2.5% of the makespan in this list
               schedule with unit times at m >= 2p
  dualpipev    DualPipeV (DeepSeek's DualPipe cut in half; torchtitan's ScheduleDualPipeV): the V
               placement of zb-v run as a fixed pattern (``dualpipe_v``, needs m >= 2p): chunk-0
               forwards fill the pipe, then in the main phase each rank pairs one micro-batch's
               forward with another's backward (F0 B1, F1 B0), and zero-bubble splits (B now, W
               later) fill the warm-up and the drain. Its point in DualPipe is to overlap the paired
               F and B (one's all-to-all behind the other's compute); here the pair runs one after
               the other and the table's bubble is what it saves
"""
from __future__ import annotations

from dataclasses import dataclass

import functools

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev")   # schedules whose B is the input gradient only, W the rest
V_PLACED = ("zb-v", "dualpipev")                  # two chunks per rank, placed in a V


@dataclass(frozen=True)
class Action:
    kind: str        # "F", "B" or "W"
    micro: int       # micro-batch index, 0..m-1
    chunk: int = 0   # local model chunk, 0..v-1 (global stage: stage_of(rank, chunk, p, placement))

    def __repr__(self):
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def validate_schedule(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ValueError (no communication) when schedule ``name`` cannot run p stages x m micro-batches x v chunks."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: expected one of {list(SCHEDULES)}")
    for key, val in (("pp", p), ("n_micro", m), ("virtual chunks v", v)):
        if int(val) != val or val < 1:
            raise ValueError(f"{key}={val} must be an integer >= 1")
    if name in V_PLACED and v != 2:
        raise ValueError(f"{name} runs two model chunks per rank (placed in a V) but v={v}: use --virtual-stages 2 "
                         f"(the trainer sets it for {name} when it is left at 1)")
    if name == "dualpipev" and m < 2 * p:
        raise ValueError(f"dualpipev needs n_micro >= 2*pp (its main phase pairs micro-batches across the V): "
                         f"n_micro={m}, pp={p}; use n_micro >= {2 * p}, or schedule 'zb-v'")
    if name not in ("interleaved",) + V_PLACED and v != 1:
        raise ValueError(f"schedule {name!r} runs one model chunk per rank but v={v}: "
                         f"use schedule 'interleaved' for v > 1, or v=1")
    if name == "interleaved" and v > 1 and m % p:
        raise ValueError(f"interleaved 1F1B needs n_micro divisible by pp (micro-batches go through the "
                         f"pipeline in groups of pp): n_micro={m}, pp={p}; use n_micro in "
                         f"{[k * p for k in range(1, 4)]}... or schedule '1f1b'")


def gpipe(p: int, m: int, rank: int) -> list:
    """All forwards, then all backwards (in the same micro-batch order on every rank)."""
    return [Action("F", j) for j in range(m)] + [Action("B", j) for j in range(m)]


def one_f_one_b(p: int, m: int, rank: int) -> list:
    """PipeDream-flush: warm up with p-rank-1 forwards, steady one-forward-one-backward, drain."""
    warmup = min(p - rank - 1, m)
    acts = [Action("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        acts += [Action("F", warmup + i), Action("B", i)]
    acts += [Action("B", j) for j in range(m - warmup, m)]
    return acts


def interleaved_1f1b(p: int, m: int, v: int, rank: int) -> list:
    """Megatron's interleaved 1F1B: virtual micro-batch k runs micro-batch (k // (p*v))*p + k % p
    on chunk (k // p) % v forward (v-1 minus that backward); m must be a multiple of p."""
    if v == 1:
        return one_f_one_b(p, m, rank)
    total = m * v

    def micro(k):
        return (k // (p * v)) * p + k % p

    def chunk(k, forward):
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    # each rank runs ahead by two forwards per downstream rank (a chunk's output goes to the
    # next rank and comes back one round later) plus one full round per extra chunk
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    acts = [Action("F", micro(k), chunk(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        k = warmup + i
        acts += [Action("F", micro(k), chunk(k, True)), Action("B", micro(i), chunk(i, False))]
    acts += [Action("B", micro(k), chunk(k, False)) for k in range(total - warmup, total)]
    return acts


def stage_of(rank: int, chunk: int, p: int, placement: str = "interleaved") -> int:
    """Global stage of local chunk ``chunk`` of pipeline rank ``rank``: interleaved c*p + r
    (Megatron's), or "v": chunk 0 is stage r, chunk 1 stage 2p-1-r (ZB-V's V shape: the first and
    the last stage on rank 0, the two middle ones on rank p-1)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def rank_of(stage: int, p: int, placement: str = "interleaved") -> tuple:
    """(rank, local chunk) holding global ``stage``: the inverse of stage_of."""
    if placement == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def placement_of(name: str) -> str:
    """How schedule ``name`` places its chunks: "v" for zb-v and dualpipev, else "interleaved"."""
    return "v" if name in V_PLACED else "interleaved"


@functools.lru_cache(maxsize=64)
def list_schedule(p: int, m: int, v: int = 1, placement: str = "interleaved", costs: tuple | None = None) -> tuple:
    """The zero-bubble tables for every rank: the list schedule of F, B, W actions of unit time, or
    of ``costs`` (a tuple of one (F, B, W) triple per global stage, any positive unit: the
    measured times, see PipelineExecutor's measured costs; B is the input gradient only).

    Each rank runs, per chunk, its F's, B's and W's each in micro-batch order; at every moment the
    rank free earliest starts the action that can start earliest (ties: B, then F, then W; among
    chunks the later stage first). v = 1 (ZB-H1): an F only while fewer than p-r micro-batches are
    between their F and their B (1F1B's bound) and fewer than 2p-r-1 between their F and their W
    (at most p-r-1 W passes deferred, as the paper's ZB-H1: without that bound the W's of every
    micro-batch would wait for the drain, and their inputs with them). v = 2 in the V placement
    (ZB-V): at most 2p chunk micro-batches between F and B on any rank (each chunk is half a
    stage: p stages' worth, 1F1B's first-stage bound), one slot kept for chunk 1 so that chunk 0's
    F's cannot fill it, and at most 4p-1 between F and W. The order is the table the executor runs;
    the times are only how it was found."""
    S = p * v
    if costs is not None and (len(costs) != S or any(len(c) != 3 or min(c) <= 0 for c in costs)):
        raise ValueError(f"costs must be {S} (F, B, W) triples of positive times, one per stage; got {costs!r}")
    dur = {k: [1.0 if costs is None else float(costs[st][i]) for st in range(S)] for i, k in enumerate("FBW")}
    nxt = {k: [[0] * v for _ in range(p)] for k in "FBW"}
    clock = [0.0] * p
    done = {}                                    # (kind, micro, stage) -> end time
    between = [0] * p                            # F done, B not yet (chunk micro-batches)
    unweighted = [0] * p                         # F done, W not yet
    wq = [[] for _ in range(p)]                  # (micro, chunk) whose B ran, W not yet, in order
    out = [[] for _ in range(p)]
    if v == 1:
        f_cap = [p - r for r in range(p)]
        w_cap = [2 * p - r - 1 for r in range(p)]
    else:
        f_cap, w_cap = [2 * p] * p, [4 * p - 1] * p
    for _ in range(3 * m * S):
        best = None
        for r in range(p):
            opts = []
            for c in range(v):
                st = stage_of(r, c, p, placement)
                j = nxt["B"][r][c]
                if j < m and ("F", j, st) in done and (st == S - 1 or ("B", j, st + 1) in done):
                    t = max(clock[r], done[("F", j, st)], done.get(("B", j, st + 1), 0.0))
                    opts.append((t, 0, -st, "B", j, c))
                j = nxt["F"][r][c]
                reserve = 1 if (v > 1 and c == 0) else 0
                if j < m and between[r] < f_cap[r] - reserve and unweighted[r] < w_cap[r] and \
                        (st == 0 or ("F", j, st - 1) in done):
                    opts.append((max(clock[r], done.get(("F", j, st - 1), 0.0)), 1, -st, "F", j, c))
            if wq[r]:
                j, c = wq[r][0]
                opts.append((clock[r], 2, 0, "W", j, c))
            if opts:
                o = min(opts)
                if best is None or (o[0], o[1], r) < (best[0][0], best[0][1], best[1]):
                    best = (o, r)
        if best is None:
            raise RuntimeError(f"list schedule for p={p}, m={m}, v={v}, {placement} cannot proceed")
        (t, _, _, kind, j, c), r = best
        clock[r] = t + dur[kind][stage_of(r, c, p, placement)]
        done[(kind, j, stage_of(r, c, p, placement))] = clock[r]
        nxt[kind][r][c] += 1
        between[r] += {"F": 1, "B": -1, "W": 0}[kind]
        unweighted[r] += {"F": 1, "B": 0, "W": -1}[kind]
        if kind == "B":
            wq[r].append((j, c))
        elif kind == "W":
            wq[r].pop(0)
        out[r].append(Action(kind, j, c))
    return tuple(tuple(a) for a in out)


def measured_costs(times) -> tuple:
    """The (F, B, W) per global stage a split schedule's table is built for, from one step's
    seconds per micro-batch and stage (S, 3: the stats' stage_times of the stages' ranks, put
    together so that every rank of the job has the same array -- ParallelRunner sums one
    replica's over the world, each stage from one rank, which is exact). In units of 1/8 of the
    mean F, at least 1/8: a table does not change on noise finer than that."""
    t = np.asarray(times, dtype=np.float64)  # host
    unit = max(float(t[:, 0].mean()), 1e-12) / 8
    return tuple(tuple(max(1, int(round(x / unit))) / 8 for x in row) for row in t)


def zb_h1(p: int, m: int, rank: int, costs: tuple | None = None) -> list:
    """ZB-H1 (see the module docstring and list_schedule)."""
    return list(list_schedule(p, m, 1, "interleaved", costs)[rank])


def zb_v(p: int, m: int, rank: int, costs: tuple | None = None) -> list:
    """ZB-V: two chunks per rank in the V placement (see list_schedule)."""
    return list(list_schedule(p, m, 2, "v", costs)[rank])


def dualpipe_v(p: int, m: int, rank: int) -> list:
    """DualPipeV's actions on ``rank`` (V placement: chunk 0 is stage rank, chunk 1 stage 2p-1-rank),
    m >= 2p. Eight phases, per rank r (DeepSeek's DualPipeV):
      1. 2(p-r-1) forwards of chunk 0               5. p-r-1 times: B1; F1 B0
      2. r+1 times: F0 F1                           6. r+1 times: B1 B0, split (B now, W later) from
      3. p-r-1 times: B1 (split), its W, F1            the middle on (r odd: from that B1; even: B0)
      4. m-2p+r+1 times: F0 B1; F1 B0 (the pairs)   7. p-r-1 times: a deferred W; B0 (split)
                                                    8. the r+1 deferred W's left
    Each chunk's F's, B's and W's go in micro-batch order; a B that is not split is followed by its
    own W at once (the executor's B is the input gradient only, W the rest)."""
    out, nf, nb, deferred = [], [0, 0], [0, 0], []

    def f(c):
        out.append(Action("F", nf[c], c))
        nf[c] += 1

    def b(c, split=False):
        out.append(Action("B", nb[c], c))
        if split:
            deferred.append(Action("W", nb[c], c))
        else:
            out.append(Action("W", nb[c], c))
        nb[c] += 1

    def w():
        out.append(deferred.pop(0))

    r = rank
    for _ in range(2 * (p - r - 1)):
        f(0)
    for _ in range(r + 1):
        f(0)
        f(1)
    for _ in range(p - r - 1):
        b(1, split=True)
        w()
        f(1)
    for _ in range(m - 2 * p + r + 1):
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(p - r - 1):
        b(1)
        f(1)
        b(0)
    split, half = False, (r + 1) // 2
    for i in range(r + 1):
        split = split or (i == half and r % 2 == 1)
        b(1, split)
        split = split or (i == half and r % 2 == 0)
        b(0, split)
    for _ in range(p - r - 1):
        w()
        b(0, split=True)
    while deferred:
        w()
    return out


def overlap_pairs(actions) -> set:
    """Where DualPipeV's table pairs a forward with a backward to overlap: the indices i with
    actions[i] an F and actions[i + 1] a B of the other chunk (its phases 4 and 5: F0 & B1, F1 & B0).
    The two touch different micro-batches and chunks, and neither needs what the other sends (tests/
    test_pp.py runs every rank to the end with each pair's inputs received before it and its outputs
    sent after it), so they may run interleaved (parallel/overlap.py)."""
    return {i for i in range(len(actions) - 1)
            if actions[i].kind == "F" and actions[i + 1].kind == "B" and actions[i].chunk != actions[i + 1].chunk}


def build_schedule(name: str, p: int, m: int, v: int = 1, rank: int = 0, costs: tuple | None = None) -> list:
    """The action list of ``rank`` for schedule ``name`` (validated first). costs: the split
    schedules' (F, B, W) per global stage to build the table for (list_schedule; None: unit times);
    the other schedules are fixed patterns and ignore it. A new list each call (of the same
    immutable actions: the unit-time tables are kept, the planner asks for the same ones thousands
    of times)."""
    return list(_table(name, p, m, v, rank)) if costs is None else _build(name, p, m, v, rank, costs)


@functools.lru_cache(maxsize=4096)
def _table(name: str, p: int, m: int, v: int, rank: int) -> tuple:
    return tuple(_build(name, p, m, v, rank, None))


def _build(name: str, p: int, m: int, v: int, rank: int, costs) -> list:
    validate_schedule(name, p, m, v)
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank} must be in 0..{p - 1}")
    if name == "gpipe":
        return gpipe(p, m, rank)
    if name == "1f1b":
        return one_f_one_b(p, m, rank)
    if name == "zb-h1":
        return zb_h1(p, m, rank, costs)
    if name == "zb-v":
        return zb_v(p, m, rank, costs)
    if name == "dualpipev":
        return dualpipe_v(p, m, rank)
    return interleaved_1f1b(p, m, v, rank)


def peak_in_flight(actions, until: str = "B") -> int:
    """Most micro-batches (counted per chunk) whose F ran and whose ``until`` action ("B", or "W")
    did not yet, at any point of the list."""
    live, peak = set(), 0
    for a in actions:
        key = (a.micro, a.chunk)
        if a.kind == "F":
            live.add(key)
            peak = max(peak, len(live))
        elif a.kind == until:
            live.discard(key)
    return peak


def peak_held(actions) -> int:
    """Most micro-batches (per chunk) whose activations a rank holds at once: from F to B, and in
    the split schedules on to W (the deferred weight gradients keep the layers' inputs and output
    gradients: the ledger counts a held micro-batch at the larger of its ctx and what its W keeps,
    ledger.wgrad_hold_per_micro)."""
    return peak_in_flight(actions, "W" if any(a.kind == "W" for a in actions) else "B")


@dataclass(frozen=True)
class _Compiled:
    """Action lists as numbers for simulate: per rank, (action id, kind 0/1/2 = F/B/W, the ids it
    waits for, whether each crosses a stage boundary); ``actions`` maps an id back (messages)."""
    ranks: tuple
    actions: tuple
    split: bool


def _compile(schedules, p: int, v: int, placement: str) -> _Compiled:
    n_stage = p * v
    ids, ranks, actions = {}, [], []
    for r, sched in enumerate(schedules):
        for a in sched:
            key = (a.kind, a.micro, stage_of(r, a.chunk, p, placement))
            if key in ids:
                raise RuntimeError(f"rank {r} runs {a} twice")
            ids[key] = len(actions)
            actions.append(a)
    for r, sched in enumerate(schedules):
        row = []
        for a in sched:
            s = stage_of(r, a.chunk, p, placement)
            if a.kind == "F":
                need = [("F", a.micro, s - 1)] if s > 0 else []
            elif a.kind == "W":
                need = [("B", a.micro, s)]
            else:
                need = [("F", a.micro, s)] + ([("B", a.micro, s + 1)] if s < n_stage - 1 else [])
            # an action no list runs is waited for forever: an id past the end is never done
            row.append((ids[(a.kind, a.micro, s)], "FBW".index(a.kind),
                        tuple(ids.get(k, len(actions)) for k in need), tuple(k[2] != s for k in need)))
        ranks.append(tuple(row))
    return _Compiled(tuple(ranks), tuple(actions), any(a.kind == "W" for a in actions))


@functools.lru_cache(maxsize=4096)
def table_peaks(name: str, p: int, m: int, v: int = 1, rank: int = 0) -> tuple:
    """(peak_in_flight, peak_held) of ``rank``'s unit-time table of schedule ``name`` (kept)."""
    actions = _table(name, p, m, v, rank)
    return peak_in_flight(actions), peak_held(actions)


@functools.lru_cache(maxsize=1024)
def compiled_table(name: str, p: int, m: int, v: int = 1) -> _Compiled:
    """Schedule ``name``'s unit-time tables of all p ranks, compiled for simulate (kept: the
    planner simulates the same tables for thousands of layouts)."""
    return _compile([build_schedule(name, p, m, v, r) for r in range(p)], p, v, placement_of(name))


def simulate(schedules, p: int, v: int = 1, f_cost: float = 1.0, b_cost: float = 2.0, comm_cost: float = 0.0,
             w_cost: float | None = None, placement: str = "interleaved"):
    """Run the per-rank action lists as a discrete-event model (F costs f_cost/v, B b_cost/v).

    b_cost is the whole backward; in lists with W actions B costs (b_cost - w_cost)/v and W
    w_cost/v (w_cost None: half of b_cost, the weight gradients' share of the backward GEMMs).
    An action waits for the actions it needs (F the previous stage's F, B its own stage's F and
    the next stage's B, W its B), plus comm_cost when they ran on another stage.

    ``schedules[r]`` is rank r's list, or ``schedules`` is compiled_table(...) of a named
    schedule (then ``placement`` is the table's). Returns {"makespan", "busy" (per rank),
    "bubble" (per rank: idle fraction of the makespan)}. Raises RuntimeError naming the blocked
    actions when the lists deadlock or miss a dependency, or an action runs twice.
    """
    c = schedules if isinstance(schedules, _Compiled) else _compile(schedules, p, v, placement)
    w = b_cost / 2 if w_cost is None else w_cost
    cost = (f_cost / v, (b_cost - w if c.split else b_cost) / v, w / v)
    done = [None] * (len(c.actions) + 1)   # finish time per action id; the last: never done
    pos = [0] * p
    clock = [0.0] * p
    busy = [0] * p                         # each rank's costs summed in its list's order
    finished, total = 0, len(c.actions)
    while finished < total:
        progressed = False
        for r in range(p):
            row, k, t, u = c.ranks[r], pos[r], clock[r], busy[r]
            while k < len(row):
                aid, kind, need, cross = row[k]
                ready = t
                for n, x in zip(need, cross):
                    d = done[n]
                    if d is None:
                        break
                    d = d + comm_cost if x else d
                    if d > ready:
                        ready = d
                else:
                    t = ready + cost[kind]
                    u += cost[kind]
                    done[aid] = t
                    k += 1
                    continue
                break
            if k != pos[r]:
                finished += k - pos[r]
                pos[r], clock[r], busy[r] = k, t, u
                progressed = True
        if not progressed:
            blocked = {r: c.actions[c.ranks[r][pos[r]][0]] for r in range(p) if pos[r] < len(c.ranks[r])}
            raise RuntimeError(f"pipeline schedule deadlocks: ranks blocked at {blocked}")
    makespan = max(clock)
    return {"makespan": makespan, "busy": busy,
            "bubble": [1.0 - b / makespan if makespan else 0.0 for b in busy]}


def bubble_formula(name: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """The textbook bubble fraction: (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1); zb-h1 (Qi et al.,
    with the F, B (input gradient) and W times f, b, w) (p-1)(f+b-w) / (m(f+b+w) + (p-1)(f+b-w));
    dualpipev (p-1)(f+b-w) / (2m(f+b+w) + (p-1)(f+b-w)): half-stage chunks idle p-1 times."""
    if name == "zb-h1":
        idle = (p - 1) * max(f + b - w, 0.0)
        return idle / (m * (f + b + w) + idle)
    if name == "zb-v":                     # the paper's ideal (F = B = W, m >= 2p)
        return 0.0
    if name == "dualpipev":                # p-1 chunk-times of F+B-W idle per rank (exact for F = B = W
        idle = (p - 1) * max(f + b - w, 0.0)   # and whenever B <= F; more when B > F: test_pp.py)
        return idle / (2 * m * (f + b + w) + idle)
    vv = v if name == "interleaved" else 1
    return (p - 1) / (vv * m + p - 1)
