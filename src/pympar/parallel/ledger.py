"""The memory ledger: a rank's bytes by category, measured from what it holds and predicted
from the configuration alone (the planner's model) -- the same categories both ways.

    parameters     the weights this rank keeps (its stages, tp shard, experts, ZeRO-3 rows)
    gradients      what persists of the gradients -- zero 0 the bucket buffers, zero 1 the full
                   gradients (the reduced rows land in their own rows), zero 2/3 the reduced
                   rows -- and, zero 2/3, the most full gradients alive at once (the buckets
                   being filled)
    optimizer      AdamW's m and v (ZeRO: of this rank's rows only)
    activations    what forward keeps for backward: one micro-batch's ctx (each buffer counted
                   once) times the micro-batches in flight (the pipeline schedule's peak)
    communication  buffers of collectives in flight: ZeRO's packed reduce-scatter sends, the
                   parameters ZeRO-3 has gathered, pipeline receive buffers
    workspace      the largest transient of one operation: the head's backward over the
                   (tokens, vocab) logits, attention's scratch (tiled: O(T * head size) per
                   kernel thread; materialized: the (B, heads, T, T) scores), a recomputed block;
                   and, under bf16 compute, the step's weight cache (a bf16 copy and two packs of
                   every weight, 6 bytes per element: nn.products.compute_copies)

``peak`` = the sum of the six: the moment backward starts, with everything forward kept, the
head's backward running, the pieces ZeRO-3 has gathered and the collectives in flight. (A
transient freed early is not always reused by what is allocated later -- pympar keeps freed
memory in the process, kernels/malloc_policy.py -- so the sum is closer to the peak RSS than the largest
live set would be.) The process adds its ``baseline`` (interpreter, libraries, MPI) to that:
VmHWM, measured from outside, is what these account for (bench/memory.py sets the three side by
side).
"""
from __future__ import annotations

import math

from ..backend import held_bytes
from ..nn import gpt, layers
from ..nn.gpt import Head
from .dp import MAX_INFLIGHT_BUCKETS       # the reduce-scatters data parallelism keeps in flight at once

def tiled_attention(act_bytes: int, compute: str = "bfloat16") -> bool:
    """Whether attention on activations of this many bytes runs the tiled kernel on this host
    (nn.attention_core: float32/float64/bfloat16 NumPy with the C++ kernels; CuPy is not modelled).
    ``compute``: which 2-byte dtype (float16 runs the materialized path)."""
    from ..nn.attention_core import tiled_available
    return act_bytes in (2, 4, 8) and tiled_available({2: compute, 4: "float32", 8: "float64"}[act_bytes])


def _threads(threads):
    from .. import kernels
    return kernels.get_num_threads() if threads is None else int(threads)


CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "workspace")


def proc_status_bytes(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM: the peak resident memory; VmRSS; RssAnon), 0
    where there is none."""
    return _stat("/proc/self/status", field + ":") * 1024


MEMORY_FIELDS = ("rss", "rss_anon", "peak_rss", "ledger_peak")


def memory_vector(world: int, rank: int, ledger_peak: int):
    """This rank's slots of the step's memory figures, (len(MEMORY_FIELDS) * world,): its VmRSS,
    RssAnon, VmHWM and ledger peak at its own place, zeros elsewhere -- a SUM over the world gives
    every rank's figures in one vector (it rides on the step's allreduce)."""
    import numpy as np

    v = np.zeros((len(MEMORY_FIELDS), world), np.float64)        # host
    v[:, rank] = (proc_status_bytes("VmRSS"), proc_status_bytes("RssAnon"), proc_status_bytes("VmHWM"), ledger_peak)
    return v.reshape(-1)


def memory_summary(v, world: int) -> dict:
    """The summed memory vector -> per field: rank 0's value, the largest and its rank."""
    import numpy as np

    m = np.asarray(v, np.float64).reshape(len(MEMORY_FIELDS), world)   # host
    out = {}
    for k, row in zip(MEMORY_FIELDS, m):
        r = int(np.argmax(row))
        out[k] = dict(rank0=int(row[0]), max=int(row[r]), max_rank=r)
    return out


def memory_record(summary: dict) -> dict:
    """memory_summary's figures as a metrics record's fields: ``{field}_bytes`` (rank 0's) and
    ``{field}_max_bytes`` for each, and ``{field}_max_rank`` for the peaks (the rank to look at)."""
    out = {}
    for k, fig in summary.items():
        out[f"{k}_bytes"], out[f"{k}_max_bytes"] = fig["rank0"], fig["max"]
        if k in ("peak_rss", "ledger_peak"):
            out[f"{k}_max_rank"] = fig["max_rank"]
    return out


def peak(ledger: dict) -> int:
    return int(sum(ledger[k] for k in CATEGORIES))


def with_peak(ledger: dict) -> dict:
    """The six categories, ``peak``, and ``gradients_transient`` (the part of ``gradients`` that
    ZeRO-2/3 hold only while buckets fill: model state = parameters + gradients - it + optimizer)."""
    out = {k: int(ledger.get(k, 0)) for k in CATEGORIES}
    out["peak"] = peak(out)
    out["gradients_transient"] = int(ledger.get("gradients_transient", 0))
    return out


# --- prediction from the configuration -----------------------------------------------------------
def is_moe_layer(cfg, i: int) -> bool:
    return bool(cfg.n_expert) and cfg.is_moe_block(i)


def params_per_rank(cfg, tp: int, ep: int, stage_blocks, first: bool, last: bool, etp=None) -> int:
    """Parameter elements a rank holds: its stages' blocks (tp shard, its experts: n_expert/ep of them,
    each split over etp, default tp), the embeddings on the first stage, ln_f and the tied head copy
    on the last (before ZeRO-3)."""
    etp = tp if etp is None else etp
    C = cfg.n_embd
    b = C if cfg.bias else 0
    n = 0
    for i in stage_blocks:
        n += 2 * (C + b)                                       # ln_1, ln_2
        n += (3 * C * C + 3 * b) // tp + C * C // tp + b       # c_attn (column), c_proj (row) + bias
        mlp = (4 * C * C + 4 * b) // tp + 4 * C * C // tp + b
        if is_moe_layer(cfg, i):
            n += cfg.n_expert * C                              # the router, replicated
            n += (cfg.n_expert // ep) * ((4 * C * C + 4 * b) // etp + 4 * C * C // etp + b)
            if cfg.shared_expert:
                n += mlp
        else:
            n += mlp
    vshard = -(-cfg.vocab_size // tp)
    rows = min(vshard, cfg.vocab_size)                         # the worst tp rank's wte rows
    if first:
        n += rows * C + cfg.block_size * C
    if last:
        n += C + b + (0 if first else rows * C)
    return n


def activations_per_micro(cfg, B: int, T: int, tp: int, sp: bool, recompute: str, blocks, last: bool,
                          first: bool, act_bytes: int, stat_bytes: int, ep: int = 1, tiled=None, gather: int = 1) -> int:
    """Bytes one micro-batch's forward keeps for backward on a rank holding ``blocks`` (the ctx the
    modules of pympar.nn and parallel.tp return, each buffer once). ``tiled``: attention runs the
    tiled kernel (None: as it would on this host, tiled_attention). ``gather``: Ulysses attention
    over the positions of this many cp ranks (ulysses_span(); 1: none), whose ctx keeps its own
    whole-sequence q, k, v and output beside the block's (and, materialized, gather x the
    probabilities: 1/gather of the heads over gather x the positions)."""
    C, H = cfg.n_embd, cfg.n_head
    tiled = tiled_attention(act_bytes) if tiled is None else tiled
    N = B * T
    s = tp if sp else 1                                        # rows of the sequence this rank keeps
    a, st = act_bytes, stat_bytes
    total = N * 8 if first else 0                              # the token ids (int64)
    for i in blocks:
        if recompute == "full":
            total += N * C * a // s                            # the block's input only
            continue
        blk = (2 * N * C // s) * a + 4 * (N // s) * st         # x, x1 (+ LN statistics); h1, h2 recomputed
        if tiled:
            blk += (3 + 1) * N * (C // tp) * a + B * (H // tp) * T * st  # qkv, attention output, lse
        else:
            blk += (3 + 1 + 1) * N * (C // tp) * a             # qkv, scaled q, attention output
            if recompute != "selective":
                blk += gather * B * (H // tp) * T * T * a      # the probabilities
        if gather > 1:
            blk += (3 + 1) * N * (C // tp) * a                 # Ulysses' whole-sequence qkv and output
        if is_moe_layer(cfg, i):
            blk += (N * C // s) * a + _moe_ctx(cfg, N, tp, a, st)   # a MoE keeps its input h2
        elif mlp_keeps_hidden(tp, recompute):
            blk += 4 * N * (C // tp) * a                       # c_fc output (the GELU output is recomputed)
        total += blk
    if last:
        vloc = -(-cfg.vocab_size // tp)
        total += (N * C // s) * a + 2 * (N // s) * st          # ln_f's input and statistics
        total += N * C * a + N * st + N * 8                     # its output, lse, targets
        if tp > 1 or Head.chunk_rows(N, vloc) >= N:
            total += N * vloc * max(a, st)                     # the logits (kept unless chunked; float32
    return int(total)                                          # under mixed precision)


def wgrad_hold_per_micro(cfg, B: int, T: int, tp: int, sp: bool, blocks, last: bool, first: bool,
                         act_bytes: int, stat_bytes: int) -> int:
    """Bytes one micro-batch's deferred weight gradients keep from its B pass to its W pass
    (zero-bubble schedules: WeightGrads.nbytes): every Linear's input and output gradient, the
    embedding's dx and token ids, the one-chunk head's logits gradient and ln_f output. Often more
    than the ctx forward kept (a dense block: 16C per token against its 10C), whatever the
    recomputation mode: B computes again what W needs."""
    C = cfg.n_embd
    N = B * T
    a = act_bytes
    s = tp if sp else 1
    Ct = C // tp
    # a dense MLP: c_fc's input (ln_2's output) and dh; c_proj's dy and input (GELU's output)
    mlp = (N * C + 8 * N * Ct + N * C // s) * a
    total = 0
    for i in blocks:
        # attention: c_attn's input (ln_1's output, gathered whole under sp) and dqkv; c_proj's
        # dy (its rows) and input (the attention output)
        blk = (N * C + 3 * N * Ct + N * C // s + N * Ct) * a
        if is_moe_layer(cfg, i):
            E, k = cfg.n_expert, cfg.top_k
            M = N * k if not cfg.capacity_factor else min(N * k, E * math.ceil(k * N * cfg.capacity_factor / E))
            blk += M * (2 * C + 8 * Ct) * a + N * C * a + N * E * stat_bytes   # experts; router: input, dlogits
            blk += mlp if cfg.shared_expert else 0
        else:
            blk += mlp
        total += blk
    if first:
        total += N * C * stat_bytes + N * 8                    # the embedding's dx (float32) and ids
    if last:
        vloc = -(-cfg.vocab_size // tp)
        if tp > 1 or Head.chunk_rows(N, vloc) >= N:
            total += N * vloc * a + N * C * a                  # dlogits, ln_f's output
    return int(total)


def mlp_keeps_hidden(tp: int, recompute: str) -> bool:
    """Whether a dense block's MLP keeps its hidden layer for backward (nn.layers.MLP.keep_hidden):
    in 'none', and always when tensor-parallel."""
    return tp > 1 or recompute == "none"


def mlp_backward_bytes(N: int, C: int, tp: int, recompute: str, deferred_w: bool, act_bytes: int,
                       consume: bool = False) -> int:
    """The transient of a dense MLP's backward over N tokens (nn.layers.MLP): its dx (made while
    the last block's hidden gradient is alive; in blocks, each block's written into it -- or, with
    ``consume`` (a Block's backward, whose ln_2 output is its own), written over the input, unless
    tensor-parallel or W deferred), a block's GELU output (its gradient written over it; every
    block's, and their hidden gradients, when a zero-bubble schedule defers the W passes), and the
    block's hidden layer computed again when it was not kept."""
    r, H = _mlp_rows(N, tp), 4 * (C // tp)
    hid = (2 * N if deferred_w else r) * H + (0 if mlp_keeps_hidden(tp, recompute) else r * H)
    dx = 0 if consume and tp == 1 and not deferred_w else N * C
    return int((dx + hid) * act_bytes)


def _mlp_rows(N: int, tp: int) -> int:
    """Rows of one MLP block (nn.layers.MLP.block_rows)."""
    return N if tp > 1 else min(N, layers.MLP_ROWS)


def _moe_ctx(cfg, N, tp, a, st):
    """A MoE layer's ctx (dropless, routing assumed even): routing tensors, the permuted rows in
    and out, each expert's MLP ctx (x rows and the hidden pre-activation, width / tp; the GELU
    output is recomputed in backward)."""
    C, E, k = cfg.n_embd, cfg.n_expert, cfg.top_k
    M = N * k if not cfg.capacity_factor else min(N * k, E * math.ceil(k * N * cfg.capacity_factor / E))
    out = N * E * st + N * st * 2 + N * k * (8 + st) + M * (8 + 8 + st)   # probs, lse, ssum, idx, gates, order, rows, gates
    out += 2 * M * C * a + 4 * M * (C // tp) * a                          # xs, ys, experts' h (g recomputed)
    if cfg.shared_expert:
        out += 4 * N * (C // tp) * a                         # the shared expert's h (g recomputed)
    return out


def unit_sizes(cfg, tp: int, ep: int, blocks, first: bool, last: bool, etp=None):
    """Parameter elements of each piece ZeRO-3 gathers alone: wte and wpe apart, each block, ln_f."""
    C = cfg.n_embd
    out = [params_per_rank(cfg, tp, ep, [i], False, False, etp) for i in blocks]
    rows = min(-(-cfg.vocab_size // tp), cfg.vocab_size)
    if first:
        out += [rows * C, cfg.block_size * C]
    if last:
        out += [C + (C if cfg.bias else 0)] + ([] if first else [rows * C])
    return out


def workspace_bytes(cfg, B, T, tp, recompute, blocks, last, act_bytes, stat_bytes, tiled=None,
                    threads=None, deferred_w=False, gather: int = 1) -> int:
    """The largest transient of one operation (see the module docstring). ``threads``: the kernel
    threads (None: this process's kernels.get_num_threads()). ``deferred_w``: a zero-bubble
    schedule defers the weight gradients (an MLP's GELU output then lives until its W pass).
    ``gather``: as activations_per_micro's (attention's scratch then spans gather x T positions)."""
    C, H = cfg.n_embd, cfg.n_head
    N = B * T
    Ta = gather * T                                            # the positions one attention spans
    tiled = tiled_attention(act_bytes) if tiled is None else tiled
    hs = C // H
    if tiled and act_bytes == 2:    # bf16 on pympar's kernel (csrc/amx_attention.cpp), each thread's backward: copies
        # of q, k, v, dO and K^T and four packs (bf16), dQ^T (float32), Dv and lse, two 32 x 32 tiles
        att = _threads(threads) * (9 * Ta * hs * 2 + Ta * hs * 4 + 2 * Ta * 4 + 2 * 32 * 32 * 4)
    elif tiled:     # each thread's backward scratch (csrc/attention.cpp): q scaled, q^T, dout, dout^T,
        tile = 64               # k and v packed, dq; a group of 4 key tiles' dk, dv; two (tile, tile)
        att = _threads(threads) * (7 * Ta * hs + Ta + 2 * 4 * tile * hs + 2 * tile * tile) * act_bytes
    else:
        att = 2 * gather * B * (H // tp) * T * T * act_bytes    # scores/probabilities and their gradient
        if recompute == "selective":
            att *= 2                                           # the recomputed scores too
    cands = [att if blocks else 0]
    mlp = 0
    if blocks:                     # an MLP's backward, beside ln_2's output computed again
        dense = not all(is_moe_layer(cfg, j) for j in blocks)   # (a MoE layer's experts do not overwrite)
        mlp = N * C * act_bytes + mlp_backward_bytes(N, C, tp, recompute, deferred_w, act_bytes, consume=dense)
        cands.append(mlp)
    if last:
        vloc = -(-cfg.vocab_size // tp)
        rows = N if tp > 1 else Head.chunk_rows(N, vloc)
        # a chunk's logits (when recomputed), exp(logits - lse) and dlogits, and the tied weight's
        # gradient product before it is added (chunked: in vocabulary blocks of a chunk's size)
        prod = vloc * C if rows >= N else min(vloc, max(1, gpt.CE_CHUNK // C)) * C
        cands.append((2 + (rows < N)) * rows * vloc * max(act_bytes, stat_bytes) + prod * stat_bytes)
    if recompute == "full" and blocks:  # one block's ctx again (a dense MLP's hidden layer aside):
        for i in {is_moe_layer(cfg, j): j for j in blocks}.values():     # a dense and a MoE one
            again = activations_per_micro(cfg, B, T, tp, False, "none", [i], False, False,
                                          act_bytes, stat_bytes, tiled=tiled, gather=gather)
            beside = mlp
            if not is_moe_layer(cfg, i) and not mlp_keeps_hidden(tp, recompute):
                again += (N * C - 4 * N * C) * act_bytes       # ln_2's output instead of c_fc's
                beside -= N * C * act_bytes                    # (then not computed again)
            cands.append(again + max(att, beside))
    return int(max(cands))


def predict(cfg, *, dp=1, pp=1, tp=1, ep=1, etp=None, zero=0, recompute="none", sp=False, micro_batch_size=1,
            n_micro=1, schedule="1f1b", virtual_stages=1, master_bytes=4, act_bytes=None,
            bucket_mb=25.0, tiled=None, threads=None, cp=1, moment_bytes=None, pp_rank=None,
            cp_comm="ring", cp_a2a=0):
    """The ledger of the worst pipeline rank of a layout, and its rank: (ledger with peak, pp rank);
    with ``pp_rank``, that pipeline rank's instead.
    moment_bytes: bytes of one AdamW moment element (default master_bytes; 2 for bf16 moments).

    cp: context parallelism keeps block_size / cp positions of each sequence on a rank, shards ZeRO
    over dp x cp, and holds its attention's buffers (cp_bytes: the ring's key/value blocks and
    dK/dV partials, or Ulysses' all-to-all buffers; cp_comm and cp_a2a as Layout's)."""
    from .pp import schedules as S
    from .pp.partition import partition

    act_bytes = act_bytes or master_bytes
    moment_bytes = moment_bytes or master_bytes
    stat = master_bytes
    B, T = micro_batch_size, cfg.block_size // cp
    dp = dp * cp                                               # the gradient group (Mesh.dpcp)
    part = partition(cfg, pp, virtual_stages, placement=S.placement_of(schedule))
    worst = None
    for r in range(pp) if pp_rank is None else [pp_rank]:
        stages = part.stages_of(r)
        blocks = [i for s_ in stages for i in part.blocks(s_)]
        first, last = 0 in stages, (part.n_stage - 1) in stages
        n = params_per_rank(cfg, tp, ep, blocks, first, last, etp)
        sh = -(-n // dp)                                       # this rank's rows (padding aside)
        grads = {0: n, 1: n, 2: sh, 3: sh}[zero]                 # ZeRO-1 reduces into the full gradient
        inflight = S.table_peaks(schedule, pp, n_micro, virtual_stages, r)[1] if pp > 1 else 1   # zb-h1: until W
        per_micro = activations_per_micro(cfg, B, T, tp, sp, recompute, blocks, last, first, act_bytes, stat, ep,
                                          tiled=tiled, gather=ulysses_span(cp, cp_comm, cp_a2a))
        if pp > 1 and schedule in S.SPLIT_BACKWARD:     # a held micro-batch: its ctx, or after B its W's
            per_micro = max(per_micro, wgrad_hold_per_micro(cfg, B, T, tp, sp, blocks, last, first, act_bytes, stat))
        chunks = max(1, len(stages))
        bucket = min(n, int(bucket_mb * 2**20) // master_bytes)
        units = sorted(unit_sizes(cfg, tp, ep, blocks, first, last, etp), reverse=True) + [0, 0]
        blocks_only = sorted(unit_sizes(cfg, tp, ep, blocks, False, False, etp), reverse=True) + [0]
        comm = transient = 0
        # collectives in flight (parallel.dp bounds them to MAX_INFLIGHT_BUCKETS): a tensor larger
        # than a bucket is a bucket of its own and its own buffer (no packed copy); the MPI
        # library's working buffers are counted as half of each message (dp.inflight_bytes)
        big = max(units[0], bucket)
        pack = 0 if zero == 0 else bucket                             # ZeRO's packed copy of a bucket
        if dp > 1 and zero in (0, 1, 2):
            if units[0] > bucket:
                comm = (big // 2 + (MAX_INFLIGHT_BUCKETS - 1) * (pack + bucket // 2)) * master_bytes
            else:
                comm = MAX_INFLIGHT_BUCKETS * (pack + bucket // 2) * master_bytes
        if zero == 2:                  # the largest bucket (a tensor above bucket_mb is one) + the next
            transient = min(n, big + bucket) * master_bytes
        elif zero == 3:
            transient = min(n, units[0] + units[1]) * master_bytes    # the largest pieces being filled
            if dp > 1:       # in use + prefetched (a piece's gather is freed before its gradient
                #              is reduced, so the two do not add up), and a block's reduce-scatter
                comm = (units[0] + units[1] + (MAX_INFLIGHT_BUCKETS - 1) * (3 * blocks_only[0]) // 2) * master_bytes
        if pp > 1 and (first or last):
            # the tied wte's gradient is complete only after the first/last-stage sum at the end of
            # the pipeline step: held whole until then, and the peer's part received beside it
            wte = min(-(-cfg.vocab_size // tp), cfg.vocab_size) * cfg.n_embd
            if zero >= 2:
                transient += wte * master_bytes
            comm += wte * master_bytes
        if pp > 1:
            comm += (2 * pp * virtual_stages + 2) * B * T * cfg.n_embd * act_bytes   # posted receives
        if cp > 1 and blocks:
            comm += cp_bytes(B, T, cfg.n_embd // tp, act_bytes, cp, cp_comm, cp_a2a)
        led = dict(parameters=(sh if zero == 3 else n) * master_bytes, gradients=grads * master_bytes + transient,
                   gradients_transient=transient,
                   optimizer=2 * (sh if zero else n) * moment_bytes,
                   activations=per_micro * inflight // chunks, communication=comm,
                   workspace=workspace_bytes(cfg, B, T, tp, recompute, blocks, last, act_bytes, stat, tiled,
                                             threads, deferred_w=pp > 1 and schedule in S.SPLIT_BACKWARD,
                                             gather=ulysses_span(cp, cp_comm, cp_a2a))
                   + compute_copy_bytes(n, units, zero, act_bytes, master_bytes))
        led = with_peak(led)
        if worst is None or led["peak"] > worst[0]["peak"]:
            worst = (led, r)
    return worst


def predict_run(model_cfg, layout, run, optim, pp_rank=None) -> dict:
    """predict() for a trainer run: its layout, compute and master dtypes, moments and buckets (the
    worst pipeline rank's ledger, with peak; ``pp_rank``: that pipeline rank's) -- from the
    configuration alone, before anything is built, so the trainer can refuse a run that cannot fit
    and the start-up line can print it."""
    import numpy as np

    compute = None if run.dtype == "float32" else run.dtype      # bfloat16 or float16: 2 bytes
    master = np.dtype(run.master_dtype)
    item = 2 if compute else master.itemsize
    led, _ = predict(model_cfg, dp=layout.dp, pp=layout.pp, tp=layout.tp, ep=layout.ep, etp=layout.etp,
                     zero=int(layout.zero), recompute=layout.recompute, sp=bool(layout.seq_parallel),
                     micro_batch_size=layout.micro_batch_size, n_micro=layout.n_micro, schedule=layout.schedule,
                     virtual_stages=layout.virtual_stages, master_bytes=master.itemsize, act_bytes=item,
                     bucket_mb=run.bucket_mb, cp=layout.cp, cp_comm=layout.cp_comm, cp_a2a=layout.cp_a2a,
                     moment_bytes=2 if optim.moments_dtype == "bfloat16" else None,
                     tiled=tiled_attention(item, compute or "bfloat16"), pp_rank=pp_rank)
    return led


def _read_int(path) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stat(path, key) -> int:
    try:
        with open(path) as f:
            for line in f:
                words = line.split()
                if len(words) >= 2 and words[0] == key:
                    return int(words[1])
    except (OSError, ValueError):
        pass
    return 0


NO_LIMIT = 1 << 60          # cgroup limits at or above this mean none (v1 writes 2^63 rounded to pages)


# (mount point, limit file, usage file, reclaimable page-cache keys of memory.stat) of cgroup v2 (on
# its own, or beside v1 under unified/) and of v1's memory controller
_CGROUP_MEMORY = (("sys/fs/cgroup", "memory.max", "memory.current", ("active_file", "inactive_file")),
                  ("sys/fs/cgroup/unified", "memory.max", "memory.current", ("active_file", "inactive_file")),
                  ("sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                   ("total_active_file", "total_inactive_file")))


def _cgroup_paths(root) -> dict:
    """This process's cgroup paths from /proc/self/cgroup: {"v2": path, "memory": path}."""
    import os

    out = {}
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
                    out["v2"] = parts[2]
                elif len(parts) == 3 and "memory" in parts[1].split(","):
                    out["memory"] = parts[2]
    except OSError:
        pass
    return out


def available_memory(root: str = "/") -> int | None:
    """Bytes this node can still give to new allocations: /proc/meminfo's MemAvailable, and, where
    the process runs in memory cgroups with limits (a container, a batch system's job), the least
    room of its own cgroup and every ancestor's (limit less usage less the reclaimable page cache,
    active and inactive file pages; v2 memory.max, v1 memory.limit_in_bytes), seen from where
    /proc/self/cgroup places it under the mount (a container's namespace: its root). The smallest of
    these; None where none can be read. ``root``: the file system's root the files are read under."""
    import os
    import posixpath

    def at(path):
        return os.path.join(root, path)

    rooms = []
    meminfo = _stat(at("proc/meminfo"), "MemAvailable:")
    if meminfo:
        rooms.append(meminfo * 1024)
    where = _cgroup_paths(root)
    for mount, limit_f, usage_f, cache in _CGROUP_MEMORY:
        path = where.get("memory" if limit_f.endswith("_in_bytes") else "v2", "/")
        levels = [path]
        while levels[-1] not in ("/", ""):
            levels.append(posixpath.dirname(levels[-1]))
        for level in dict.fromkeys(levels + ["/"]):        # the cgroup, its ancestors, the mount's root
            d = at(posixpath.join(mount, level.lstrip("/")))
            limit, usage = _read_int(f"{d}/{limit_f}"), _read_int(f"{d}/{usage_f}")
            if limit is None or usage is None or limit >= NO_LIMIT:
                continue
            reclaimable = sum(_stat(f"{d}/memory.stat", k) for k in cache)
            rooms.append(max(0, limit - max(0, usage - reclaimable)))
    return min(rooms) if rooms else None


def compute_copy_bytes(n, units, zero, act_bytes, master_bytes) -> int:
    """The step's weight cache under bf16 compute (nn.products.compute_copies): each weight's bf16 copy
    and its two packs for the products (as W and as W^T), 6 bytes per element, held for the step; under
    ZeRO-3 only the gathered pieces' (the two largest, in use and prefetched)."""
    if act_bytes != 2 or master_bytes == 2:
        return 0
    return 6 * (n if zero != 3 else units[0] + units[1])


def ulysses_span(cp, comm="ring", a2a=0) -> int:
    """The cp ranks whose positions one Ulysses attention gathers: cp for 'a2a', a group's a2a for
    'a2a+ring', 1 for the ring (its attention stays on a rank's own rows)."""
    if cp <= 1 or comm == "ring":
        return 1
    return cp if comm == "a2a" else a2a


def cp_bytes(B, T_local, C_local, act_bytes, cp, comm="ring", a2a=0) -> int:
    """Context parallelism's attention buffers at their peak (the cores' peak_bytes in parallel.cp),
    in units of one activation of the rank's rows, B x T_local x C_local:
    - ring: parallel.cp.ring_buffer_blocks key/value blocks of 2 units each;
    - a2a (Ulysses): an all-to-all's send and receive buffers of q, k, v: 6 units;
    - a2a+ring (Ulysses in groups of a2a ranks, the ring across cp/a2a groups): the backward's ring
      holds the gradient it received (1 unit), its dq/dk/dv (3) and its own buffers, blocks of the
      group's rows and heads (2 units each)."""
    from .cp import ring_buffer_blocks

    if cp <= 1:
        return 0
    if comm == "a2a":
        units = 6
    elif comm == "a2a+ring":                     # (at least 10: the all-to-alls' 6 are never the most)
        if not 1 < a2a < cp or cp % a2a:
            raise ValueError(f"cp_bytes: a2a+ring needs a group size dividing cp={cp} strictly between 1 and cp, "
                             f"got {a2a}")
        units = 4 + 2 * ring_buffer_blocks(cp // a2a)
    else:
        units = 2 * ring_buffer_blocks(cp)
    return int(units * B * T_local * C_local * act_bytes)


# --- measurement on a runner -----------------------------------------------------------------------
def measure(sync, optimizer, model_params, activations: int, communication: int, workspace: int,
            transient_grads: int = 0) -> dict:
    """The ledger of what a rank holds now: its parameters' arrays, the gradient storage the sync
    keeps (+ the most full gradients zero 2/3 held at once), the optimizer's state, and the
    activation/communication/workspace peaks measured."""
    params = held_bytes([p.data for p in model_params])
    grads = transient_grads
    for d in sync.syncs:
        for b in d.buckets:
            grads += b.persistent_bytes
        if d.zero == 1:                                        # the engine's full gradients persist
            grads += held_bytes([p.grad for p in (q for _, q in d.named) if p.has_grad])
    opt = optimizer.state_bytes() if hasattr(optimizer, "state_bytes") else \
        held_bytes(list(getattr(optimizer, "m", {}).values()), list(getattr(optimizer, "v", {}).values()))
    return with_peak(dict(parameters=params, gradients=grads, optimizer=opt, activations=activations,
                          communication=communication, workspace=workspace, gradients_transient=transient_grads))


def describe(ledger: dict) -> str:
    """One line: 'params 0.50 GiB, grads ..., peak ...'."""
    short = dict(parameters="params", gradients="grads", optimizer="optimizer", activations="activations",
                 communication="comm", workspace="workspace", peak="peak")
    return ", ".join(f"{short[k]} {human(ledger[k])}" for k in (*CATEGORIES, "peak") if k in ledger)


def human(n) -> str:
    n = float(n)
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"
