"""Replicated hot experts: where extra copies of the busiest experts go (DeepSeek's expert-parallel
load balancer; the seed's "expert cache").

Each ep rank keeps its n_local home experts and ``slots`` replica slots. From the tokens each
expert received over the last window (the global counts every rank agrees on), ``place_replicas``
fills the ep * slots slots one at a time: the expert with the most tokens per copy gets a copy on
the least-loaded rank that has a free slot and no copy of it yet (ties: the lower expert id, the
lower rank), so every rank computes the same placement from the same counts. An expert's rows are
split evenly over its copies at each source (``split``), and a rank's load is the sum over its
copies of load / copies.

What a copy costs and how the run stays the same run (parallel/ep.py): a replica is not a
parameter -- the optimizer, the gradient sync and checkpoints see the home expert only. After each
backward of the layer the replicas' gradients are sent to the home rank and added to the home
expert's (in rank order), and after each optimizer step the home rank sends the updated weights to
its replicas. So the gradients are the single-process ones up to the order of their sums.
"""
from __future__ import annotations

import numpy as np


def place_replicas(loads, ep: int, slots: int):
    """loads (E,) tokens per expert -> copies: E lists of ep ranks, each the home rank
    (e // (E / ep)) first and then the replicas in the order they were placed."""
    loads = np.asarray(loads, np.float64)  # host
    E = len(loads)
    if ep < 1 or E % ep:
        raise ValueError(f"place_replicas: {E} experts do not divide over ep={ep} ranks")
    nl = E // ep
    if slots < 0 or slots > E - nl:
        raise ValueError(f"place_replicas: {slots} replica slots per rank: expected 0..{E - nl} "
                         f"(a rank holds at most one copy of each of the other ranks' {E - nl} experts)")
    copies = [[e // nl] for e in range(E)]
    free = [slots] * ep
    for _ in range(ep * slots):
        rank_load = rank_loads(loads, copies, ep)
        best = None
        for e in sorted(range(E), key=lambda e: (-loads[e] / len(copies[e]), e)):
            ranks = [r for r in range(ep) if free[r] and r not in copies[e]]
            if ranks:
                best = e, min(ranks, key=lambda r: (rank_load[r], r))
                break
        if best is None:
            break
        e, r = best
        copies[e].append(r)
        free[r] -= 1
    return copies


def valid_copies(copies, E: int, ep: int, slots: int) -> bool:
    """Whether ``copies`` is a placement of E experts over ep ranks with at most ``slots`` replicas per
    rank, as place_replicas makes (a checkpoint's, checked before use)."""
    if not isinstance(copies, list) or len(copies) != E or E % ep:
        return False
    nl, held = E // ep, [0] * ep
    for e, c in enumerate(copies):
        if not c or c[0] != e // nl or len(set(c)) != len(c) or any(not 0 <= r < ep for r in c):
            return False
        for r in c[1:]:
            held[r] += 1
    return max(held) <= slots


def rank_loads(loads, copies, ep: int):
    """Tokens each rank processes when every expert's tokens split evenly over its copies."""
    out = np.zeros(ep)  # host
    for e, cps in enumerate(copies):
        for r in cps:
            out[r] += loads[e] / len(cps)
    return out


def split(n: int, k: int):
    """n rows over k copies: the copies' (start, stop) within the expert's rows, as even as can be."""
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def max_over_mean(per_rank) -> float:
    v = np.asarray(per_rank, np.float64)  # host
    return float(v.max() / v.mean()) if v.mean() > 0 else 0.0
