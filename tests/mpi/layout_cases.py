"""The layouts of the equivalence test (tests/mpi/mpi_layouts.py): pure enumeration, no MPI.

A case is a pympar.layout.Layout (dp, pp, tp, ep, etp, cp, schedule, virtual stages, sequence
parallelism, ZeRO, recomputation) with the test's model and dtype, dp*pp*cp*tp = world.
``all_layouts(world)`` is every layout the test models admit (pp <= n_layer,
tp | n_head, ep | n_expert and ep | dp*cp, or with the experts folded apart from tp (etp a
proper divisor of tp) ep | dp*cp*tp/etp, 2*cp | block_size (cp 1, 2, 4 with block_size 8),
interleaved only where n_layer divides into pp*2 chunks, zb-v where n_layer >= 2*pp (dualpipev
also needs n_micro >= 2*pp), what
pympar.layout.check refuses as not supported left out (none at present; any other refusal
is an error of this enumeration), sequence parallelism only with tp > 1
and tp | block_size/cp, ZeRO stages 1-3 only with dp*cp > 1), each with activation
recomputation none, selective and full, in float64. ``ci_layouts(world)`` is a
representative slice: a greedy all-pairs cover (every pair of dimension values that occurs in
the full matrix occurs in some chosen layout), with float32 as one more dimension value.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

import pympar.layout
from pympar.nn.config import GPTConfig

N_LAYER, N_HEAD, N_EXPERT = 4, 8, 8
DENSE = dict(vocab_size=61, block_size=8, n_layer=N_LAYER, n_head=N_HEAD, n_embd=16)
MOE = dict(DENSE, n_expert=N_EXPERT, top_k=2, moe_every=2, capacity_factor=0.0)   # dropless
G = 8                  # global micro-batches per step (= dp * n_micro in every layout)
WORLDS = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class Layout(pympar.layout.Layout):
    """pympar's Layout (what the trainer runs) with the test's model and dtype; n_micro is G / dp,
    the micro-batch size B of tests/mpi/mpi_layouts.py. ``schedule`` "-" only in the
    name and the pair cover when pp == 1 (the runner gets 1f1b, which is what pp == 1 runs)."""
    model: str = "dense"       # "dense" | "moe"
    dtype: str = "float64"

    def __str__(self):
        s = f"dp{self.dp}.pp{self.pp}.tp{self.tp}.ep{self.ep}" + (f".etp{self.etp}" if self.folded else "") + \
            (f".cp{self.cp}" + ({"ring": ""}.get(self.cp_comm, f"-{self.cp_comm}")) +
             (f"{self.cp_a2a}" if self.cp_comm == "a2a+ring" else "") if self.cp > 1 else "") + f" {self.model}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        return s + (" sp" if self.seq_parallel else "") + (f" zero{self.zero}" if self.zero else "") + \
            (f" recompute={self.recompute}" if self.recompute != "none" else "") + f" {self.dtype}"

    def features(self):
        """(dimension, value) items whose pairs the CI slice must cover."""
        return [("shape", (self.dp, self.pp, self.tp, self.cp)), ("ep", self.ep), ("model", self.model),
                ("etp", self.etp if self.folded else "-"),
                ("schedule", self.schedule if self.pp > 1 else "-"), ("sp", self.seq_parallel), ("zero", self.zero),
                ("dtype", self.dtype), ("recompute", self.recompute), ("cp_comm", self.cp_comm if self.cp > 1 else "-")]


def _config(model):
    return GPTConfig(**(MOE if model == "moe" else DENSE))


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def all_layouts(world: int, dtypes=("float64",)):
    out = []
    T = DENSE["block_size"]
    for cp in _divisors(world):
        if T % (2 * cp) and cp > 1:
            continue
        for pp in _divisors(world // cp):
            if pp > N_LAYER:
                continue
            for tp in _divisors(world // (pp * cp)):
                if N_HEAD % tp:
                    continue
                dp = world // (pp * tp * cp)
                scheds = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)] + \
                    ([("interleaved", 2)] if N_LAYER % (2 * pp) == 0 else []) + \
                    ([("zb-v", 2)] if N_LAYER >= 2 * pp else []) + \
                    ([("dualpipev", 2)] if N_LAYER >= 2 * pp and G // dp >= 2 * pp else [])
                sps = [False, True] if tp > 1 and (T // cp) % tp == 0 else [False]
                for model in ("dense", "moe"):
                    eps = [(1, None)] if model == "dense" else \
                        [(e, None if etp == tp else etp) for etp in _divisors(tp)
                         for e in _divisors(dp * cp * tp // etp) if N_EXPERT % e == 0]
                    heads = N_HEAD // tp       # Ulysses over all cp ranks, and in groups of 2 with the ring across
                    comms = [("ring", 0)] + ([("a2a", 0)] if cp > 1 and heads % cp == 0 else []) + \
                        ([("a2a+ring", 2)] if cp > 2 and cp % 2 == 0 and heads % 2 == 0 else [])
                    for (ep, etp), (sched, v), sp, zero, dt, rc, (cc, a2a) in itertools.product(
                            eps, scheds, sps, [0, 1, 2, 3] if dp * cp > 1 else [0], dtypes, RECOMPUTE, comms):
                        lay = Layout(dp=dp, pp=pp, tp=tp, ep=ep, etp=etp, cp=cp, micro_batch_size=2, n_micro=G // dp,
                                     schedule=sched, virtual_stages=v, zero=zero, seq_parallel=sp, recompute=rc,
                                     model=model, dtype=dt, cp_comm=cc, cp_a2a=a2a)
                        try:                       # what pympar refuses as not supported is not a case
                            pympar.layout.check(_config(model), lay)
                        except pympar.layout.NotSupportedError:
                            continue
                        out.append(lay)
    return out


def _pairs(layout):
    f = layout.features()
    return {(a, b) for a, b in itertools.combinations(f, 2)}


def ci_layouts(world: int):
    """A greedy all-pairs cover of the full matrix with float32 and bfloat16 (float32 master weights,
    bf16 activations and products) added as dtype values."""
    pool = all_layouts(world, dtypes=("float64", "float32", "bfloat16"))
    random.Random(world).shuffle(pool)            # deterministic, not biased to the first shapes
    # each layout's pairs computed once, as a bit mask over the pairs that occur (every rank of a
    # launch builds this slice: at 8 ranks on 2 cores, intersecting sets of pairs per pass took over
    # a minute of the test's time limit)
    index = {}
    masks = [sum(1 << index.setdefault(p, len(index)) for p in _pairs(lay)) for lay in pool]
    pool = list(zip(pool, masks))
    want, chosen = (1 << len(index)) - 1, []
    while want:
        best, mask = max(pool, key=lambda x: (x[1] & want).bit_count())   # the first of the best
        chosen.append(best)
        want &= ~mask
        pool = [x for x in pool if x[1] & want]           # those that add nothing dropped
    return chosen


def as_float32(layout):
    return replace(layout, dtype="float32")
