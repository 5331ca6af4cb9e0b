"""Cut a GPT's blocks into pipeline stages by a FLOP cost model, and validate a pipeline layout.

Stage s (0..S-1, S = pp * v) holds blocks ``bounds[s]:bounds[s+1]``; stage 0 also holds the
embeddings (wte, wpe), stage S-1 the final LayerNorm, the tied lm_head and the loss. Rank r
holds stages r, r+pp, ... (interleaved assignment; v=1: just stage r), or with zb-v stages r
and 2pp-1-r (the V placement). Everything here is pure
arithmetic on the config: every rank computes the same answer, and a bad layout raises
ValueError before any communication.
"""
from __future__ import annotations

from dataclasses import dataclass

from .schedules import validate_schedule

TIED_TAG = 32767                     # the MPI standard's smallest guaranteed tag upper bound


def check_tags(n_micro: int, v: int) -> None:
    """Message tags are ((chunk*n_micro + micro) << 1) | kind, below the tied-weight tag."""
    if 2 * n_micro * v > TIED_TAG:
        raise ValueError(f"n_micro={n_micro} x v={v} = {n_micro * v} micro-batch chunks need message tags up to "
                         f"{2 * n_micro * v - 1}, which reaches the tied-weight tag {TIED_TAG} (the smallest tag "
                         f"limit MPI guarantees): use n_micro*v <= {TIED_TAG // 2}")


def block_flops(config, i: int, seq_len: int | None = None) -> float:
    """Forward FLOPs per token of block i (backward is ~2x for every part alike, so it cancels)."""
    C, T = config.n_embd, seq_len or config.block_size
    attn = 2 * C * 3 * C + 2 * C * C + 2 * 2 * T * C        # qkv, proj; scores and weighted sum
    if config.is_moe_block(i):
        ffn = config.top_k * 16 * C * C + 2 * C * config.n_expert
        if config.shared_expert:
            ffn += 16 * C * C
    else:
        ffn = 16 * C * C                                      # c_fc (C->4C) and c_proj (4C->C)
    return float(attn + ffn)


def embedding_flops(config) -> float:
    """Per token: a table lookup plus the add, and a scatter-add in backward: a few C."""
    return float(4 * config.n_embd)


def head_flops(config) -> float:
    """Per token: lm_head (C->V) and the cross-entropy over V: about 2*C*V + 5*V."""
    return float(2 * config.n_embd * config.vocab_size + 5 * config.vocab_size)


@dataclass(frozen=True)
class Partition:
    pp: int
    v: int
    bounds: tuple           # S+1 block indices, bounds[0] = 0, bounds[S] = n_layer
    costs: tuple            # per stage FLOPs/token including embedding/head
    placement: str = "interleaved"   # which rank holds which stage: schedules.stage_of

    @property
    def n_stage(self) -> int:
        return self.pp * self.v

    def blocks(self, stage: int) -> range:
        """Global block indices of global stage ``stage``."""
        return range(self.bounds[stage], self.bounds[stage + 1])

    def stages_of(self, rank: int) -> list:
        """Global stages held by pipeline rank ``rank``, in local chunk order."""
        from .schedules import stage_of
        return [stage_of(rank, c, self.pp, self.placement) for c in range(self.v)]

    def rank_of(self, stage: int) -> tuple:
        """(pipeline rank, local chunk) holding global ``stage``."""
        from .schedules import rank_of
        return rank_of(stage, self.pp, self.placement)


def _min_max_split(costs, k):
    """Cut ``costs`` into k non-empty contiguous groups minimising the largest group sum.

    Returns the k+1 bounds. O(k n^2) dynamic programme; ties go to the earliest cut, so every
    rank gets the same answer."""
    n = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    inf = float("inf")
    # best[j][i]: min over splits of costs[:i] into j groups of the max group sum
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                val = max(best[j - 1][s], pre[i] - pre[s])
                if val < best[j][i] - 1e-9 * abs(val):
                    best[j][i], cut[j][i] = val, s
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    return tuple(reversed(bounds))


def partition(config, pp: int, v: int = 1, seq_len: int | None = None, placement: str = "interleaved") -> Partition:
    """Balanced stage bounds for ``config.n_layer`` blocks over pp ranks x v chunks.

    v = 1, or the V placement (zb-v): contiguous cut minimising the most expensive stage, stage 0
    charged the embedding and the last stage the head and loss. v > 1 interleaved: n_layer must
    divide into pp*v equal chunks (the interleaved schedule's timing assumes equal chunks)."""
    n = config.n_layer
    for key, val in (("pp", pp), ("v", v)):
        if int(val) != val or val < 1:
            raise ValueError(f"{key}={val} must be an integer >= 1")
    S = pp * v
    if n < S:
        raise ValueError(f"n_layer={n} blocks cannot fill pp*v={pp}*{v}={S} pipeline stages "
                         f"(each stage needs at least one block): use pp*v <= {n}")
    costs = [block_flops(config, i, seq_len) for i in range(n)]
    if v > 1 and placement != "v":
        if n % S:
            ok = [k for k in range(2, n // pp + 1) if n % (pp * k) == 0]
            hint = f"v in {ok} would divide it" if ok else f"no v > 1 does with pp={pp}; use schedule '1f1b'"
            raise ValueError(f"interleaved pipeline needs n_layer divisible by pp*v: n_layer={n}, "
                             f"pp={pp}, v={v} (pp*v={S}); {hint}")
        bounds = tuple(range(0, n + 1, n // S))
    else:
        # charge the embedding to block 0 and the head to the last block while cutting
        charged = list(costs)
        charged[0] += embedding_flops(config)
        charged[-1] += head_flops(config)
        bounds = _min_max_split(charged, S)
    stage_costs = [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(S)]
    stage_costs[0] += embedding_flops(config)
    stage_costs[-1] += head_flops(config)
    return Partition(pp, v, bounds, tuple(stage_costs), placement)


def validate_pipeline(config, pp: int, n_micro: int, schedule: str = "1f1b", v: int = 1,
                      seq_len: int | None = None) -> Partition:
    """Check a whole pipeline layout (config, schedule, micro-batches) and return its Partition.

    Raises ValueError with what was wrong and what would be right; pure arithmetic, so every
    rank raises the same error before the first collective."""
    validate_schedule(schedule, pp, n_micro, v)
    check_tags(n_micro, v)
    if seq_len is not None and not 1 <= seq_len <= config.block_size:
        raise ValueError(f"sequence length {seq_len} must be in 1..block_size={config.block_size}")
    from .schedules import V_PLACED, placement_of
    if schedule in V_PLACED and config.n_layer < 2 * pp:
        fewer = f", pp <= {config.n_layer // 2}" if config.n_layer // 2 >= 2 else ""
        raise ValueError(f"{schedule} places 2 chunks per rank (2*pp = {2 * pp} stages) but n_layer={config.n_layer}: "
                         f"use n_layer >= {2 * pp}{fewer} or another schedule ({'zb-h1' if schedule == 'zb-v' else '1f1b'})")
    return partition(config, pp, v, seq_len, placement_of(schedule))
