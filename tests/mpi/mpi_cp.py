"""Context parallelism inside one mpiexec launch of cp ranks (tests/test_cp.py).

- ring attention (parallel.cp.RingAttentionCore) against the single-rank attention of the whole
  sequence, forward and backward: float64 to 1e-12, float32 to 1e-5, for sequence lengths whose
  chunks are 1 position, a few, and more than one 64-row tile of the kernel, batch 1 and 3,
  one head and several;
- its backward against the blocks' gradients summed in the ring's order (bitwise), and the
  memory it allocates (tracemalloc) against its own count and the ledger's; Ulysses' and the
  hybrid's the same way;
- a MoE model whose capacity drops assignments (the drops are decided over the whole
  micro-batch) and a dense one, cp = world against one process: losses, grad norms and every
  parameter after 3 AdamW steps, and the evaluation loss.
"""
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from pympar.comm import MPIComm
import pympar.kernels as K
from pympar.kernels import reference as R
from pympar.nn import GPT
from pympar.nn.config import GPTConfig
from pympar.optim import AdamW, OptimConfig, clip_grad_norm
from pympar.parallel.cp import RingAttentionCore, UlyssesAttentionCore, positions, ring_buffer_blocks
import pympar.layout
from pympar.parallel.runner import ParallelRunner


@pytest.fixture(scope="module")
def comm(mpi_world):
    return MPIComm(mpi_world, name="cp", timeout=60)


def _rel(a, b):
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))


def _whole_sequence(comm, dt, T, B, H, D, seed):
    """(qkv, dout) of one whole sequence (the same on every rank), one process's attention output and
    input gradient of it, and this rank's positions."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, T, 3, H, D)).astype(dt)
    dout = rng.standard_normal((B, T, H * D)).astype(dt)
    sc = 1 / np.sqrt(D)
    o_ref, lse_ref = R.attention_forward(qkv, sc)
    dqkv_ref = R.attention_backward(qkv, o_ref, lse_ref.astype(dt), dout, sc)
    return qkv, dout, o_ref, dqkv_ref, positions(T, comm.size, comm.rank)


@pytest.mark.parametrize("dt,tol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("c,B,H,D", [(1, 1, 1, 4), (3, 3, 2, 8), (37, 1, 4, 16), (70, 2, 1, 32)])
def test_ring_attention_equals_full_attention(comm, mpi_world, dt, tol, c, B, H, D):
    T = 2 * comm.size * c
    qkv, dout, o_ref, dqkv_ref, pos = _whole_sequence(comm, dt, T, B, H, D, [T, B, H, D])
    ring = RingAttentionCore(comm)
    o, ctx = ring.forward(np.ascontiguousarray(qkv[:, pos]))
    assert o.shape == (B, 2 * c, H * D) and o.dtype == np.dtype(dt)
    e_fwd = _rel(o, o_ref[:, pos])
    dqkv = ring.backward(np.ascontiguousarray(dout[:, pos]), ctx)
    e_bwd = _rel(dqkv, dqkv_ref[:, pos])
    errs = mpi_world.allgather((e_fwd, e_bwd))
    assert all(f < tol and b < tol for f, b in errs), f"forward, backward rel errors per rank: {errs}"


def test_ring_backward_is_the_blocks_summed_in_the_ring_order(comm, mpi_world):
    """dq of this rank's queries: its blocks against keys of ranks i, i-1, i-2, ...; dK, dV of its
    keys: its own block's, then the partials of ranks i+1, i+2, ... -- each block from the kernel
    with the merged o and lse, added in that order: the same bits (from cp 3 on, another order of
    the partials gives other bits)."""
    cp, i = comm.size, comm.rank
    B, c, H, D = 2, 5, 3, 8
    T = 2 * cp * c
    qkv, dout, _, _, _ = _whole_sequence(comm, np.float64, T, B, H, D, [T, 11])
    local = [np.ascontiguousarray(qkv[:, positions(T, cp, r)]) for r in range(cp)]
    douts = [np.ascontiguousarray(dout[:, positions(T, cp, r)]) for r in range(cp)]
    ring = RingAttentionCore(comm)
    o, ctx = ring.forward(local[i])
    merged = mpi_world.allgather((o, ctx[3]))            # every rank's merged o and lse
    dqkv = ring.backward(douts[i], ctx)

    def block(r, j):                                     # rank r's queries against rank j's keys
        qr, kr, causal = ring._block(j, 2 * c, i=r)
        return qr, kr, K.attention_block_backward(local[r][:, qr, 0], local[j][:, kr, 1], local[j][:, kr, 2],
                                                  merged[r][0][:, qr], merged[r][1][:, :, qr], douts[r][:, qr],
                                                  1 / np.sqrt(D), causal)
    want = np.empty_like(dqkv)
    for s in range(cp):
        qr, _, (dq, _, _) = block(i, (i - s) % cp)
        if s == 0:
            want[:, :, 0] = dq
        else:
            want[:, qr, 0] += dq
        _, kr, (_, dk, dv) = block((i + s) % cp, i)
        if s == 0:
            want[:, :, 1], want[:, :, 2] = dk, dv
        else:
            want[:, kr, 1] += dk
            want[:, kr, 2] += dv
    assert mpi_world.allreduce(int(not np.array_equal(dqkv, want))) == 0


def test_ring_backward_holds_what_it_counts(comm, mpi_world):
    """What the backward allocates at its most (tracemalloc) is the returned dqkv plus the buffers
    the ring counts, on every rank, within what else it may hold at once: NumPy's buffers for a
    strided in-place add (np.getbufsize() elements per operand), the statistics' row copies and a
    few Python objects -- under a seventh of a block here, less than the half block a partial or the scratch
    would be; the most any rank counts is the ledger's ring_buffer_blocks."""
    B, c, H, D = 2, 128, 4, 64
    dt = np.float64
    block = B * 2 * c * 2 * H * D * np.dtype(dt).itemsize        # this rank's keys and values
    rng = np.random.default_rng(comm.rank)
    qkv = rng.standard_normal((B, 2 * c, 3, H, D))
    dout = rng.standard_normal((B, 2 * c, H * D))
    ring = RingAttentionCore(comm)
    o, ctx = ring.forward(qkv)
    ring.peak_bytes = 0                                   # the backward's alone
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        dqkv = ring.backward(dout, ctx)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    want = dqkv.nbytes + ring.peak_bytes
    slack = 3 * np.getbufsize() * 8 + 4 * B * H * 2 * c * 8 + 32 * 1024
    assert slack < block / 7
    got = mpi_world.allgather((peak, want))
    assert all(w <= p <= w + slack for p, w in got), (got, block)
    assert max(mpi_world.allgather(ring.peak_bytes)) == ring_buffer_blocks(comm.size) * block


def test_ulysses_holds_what_it_counts(comm, mpi_world):
    """Ulysses and Ulysses x ring: the buffers each counts (peak_bytes), the most over ranks, are the
    ledger's cp_bytes; the backward allocates at its most (tracemalloc) what it counts, within the
    slack of the ring's test (the returned dqkv is made once the send buffer is freed); the forward
    at most what it keeps plus what it counts; what the forward keeps beside its output (the
    whole-sequence ctx) is what the ledger's activations add for Ulysses over the ring. Fails
    where the backward's send buffer outlives its all-to-all or the received gradient outlives
    the core (checked: 9 and 7 units where it counts 6; the code before both peaked at 10), and
    where the gather to whole sequences keeps its send buffer (9 units against 6)."""
    from pympar.parallel import ledger
    B, c, H, D = 2, 128, 12, 64                          # 12 heads: Ulysses at cp 2, 3 and 4
    cp, T, unit = comm.size, 2 * comm.size * c, B * 2 * c * H * D * 8
    cfg = GPTConfig(n_layer=1, n_head=H, n_embd=H * D, block_size=T, vocab_size=64)
    rng = np.random.default_rng(comm.rank)
    qkv = rng.standard_normal((B, 2 * c, 3, H, D))
    dout = rng.standard_normal((B, 2 * c, H * D))
    slack = 3 * np.getbufsize() * 8 + 4 * B * H * T * 8 + 32 * 1024
    assert slack < unit / 2                              # less than any buffer it must see (1 unit)
    seen = {}
    for name, core in _cores(comm, T, H):
        if name == "ring":
            continue
        core.backward(dout, core.forward(qkv)[1])        # once first: imports, the communicators' first calls
        o = ctx = dqkv = None                            # the last core's arrays freed before, not inside
        tracemalloc.start()                              # q, k, v to whole sequences: at most two copies
        try:                                             # at once (send and received, then received and
            base = tracemalloc.get_traced_memory()[0]    # the result), never three
            full = core._to_heads(qkv, H)
            heads_peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert full.nbytes == qkv.nbytes and heads_peak <= 2 * qkv.nbytes + slack, (name, heads_peak / unit)
        del full
        def reset():                                     # the counts of this pass only
            for counter in (core, core.ring):
                if counter is not None:
                    counter.peak_bytes = 0
        reset()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            o, ctx = core.forward(qkv)
            kept, fwd = (m - base for m in tracemalloc.get_traced_memory())
            counted_fwd = core.peak_bytes
            reset()
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            dqkv = core.backward(dout, ctx)
            bwd = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        a2a = int(name[3:].split("+")[0]) if "+" in name else 0
        kind = "a2a+ring" if a2a else "a2a"
        want = ledger.cp_bytes(B, 2 * c, H * D, 8, cp, kind, a2a)
        acts = [ledger.activations_per_micro(cfg, B, 2 * c, 1, False, "none", [0], False, False, 8, 8, tiled=True,
                                             gather=g) for g in (1, ledger.ulysses_span(cp, kind, a2a))]
        seen[name] = (fwd, kept - o.nbytes, acts[1] - acts[0], counted_fwd, bwd, core.peak_bytes, want,
                      dqkv.shape == qkv.shape)
    every = mpi_world.allgather(seen)
    for name in seen:
        assert max(max(e[name][3], e[name][5]) for e in every) == seen[name][6], (name, [e[name] for e in every])
    for e in every:
        for name, (fwd, ctx_kept, ctx_ledger, counted_fwd, bwd, counted, want, shaped) in e.items():
            assert shaped and counted <= bwd <= counted + slack, (name, bwd / unit, counted / unit)
            assert counted_fwd <= fwd <= ctx_kept + unit + counted_fwd + slack, (name, fwd / unit, counted_fwd / unit)
            assert ctx_ledger <= ctx_kept <= ctx_ledger + slack, (name, ctx_kept / unit, ctx_ledger / unit)
    assert set(seen) == ({"a2a", "a2a2+ring"} if cp == 4 else {"a2a"})


def _cores(comm, T, H):
    """(name, core) of every context-parallel attention this cp and these heads admit: the ring,
    Ulysses over all cp ranks, and Ulysses inside groups of every proper divisor u of cp with the
    ring across the groups (install_context_parallel's a2a+ring, built the same way here)."""
    cp, r = comm.size, comm.rank
    out = [("ring", RingAttentionCore(comm))]
    if H % cp == 0:
        out.append(("a2a", UlyssesAttentionCore(comm, T)))
    for u in range(2, cp):
        if cp % u == 0 and H % u == 0:
            j, i = divmod(r, u)
            group, across = comm.split(j, key=i), comm.split(i, key=j)
            out.append((f"a2a{u}+ring", UlyssesAttentionCore(group, T // across.size, ring_comm=across)))
    return out


@pytest.mark.parametrize("dt,tol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("c,B,H,D", [(1, 1, 4, 4), (3, 2, 4, 8), (9, 1, 12, 16)])
def test_every_cp_attention_equals_full_attention(comm, mpi_world, dt, tol, c, B, H, D):
    # ring, Ulysses and Ulysses x ring: this rank's positions of the whole-sequence attention,
    # forward and backward (a2a+ring exists from cp = 4: groups of 2, a ring of 2)
    cp = comm.size
    T = 2 * cp * c
    qkv, dout, o_ref, dqkv_ref, pos = _whole_sequence(comm, dt, T, B, H, D, [T, B, H, D, 7])
    errs = {}
    for name, core in _cores(comm, T, H):
        o, ctx = core.forward(np.ascontiguousarray(qkv[:, pos]))
        dqkv = core.backward(np.ascontiguousarray(dout[:, pos]), ctx)
        errs[name] = (_rel(o, o_ref[:, pos]), _rel(dqkv, dqkv_ref[:, pos]))
    every = mpi_world.allgather(errs)
    assert all(f < tol and b < tol for e in every for f, b in e.values()), every
    if cp == 4:
        assert "a2a2+ring" in errs


def test_positions_cover_every_position_once(comm):
    for cp in range(1, 6):
        T = 2 * cp * 3
        got = np.concatenate([positions(T, cp, r) for r in range(cp)])
        assert sorted(got.tolist()) == list(range(T))
        assert all(len(positions(T, cp, r)) == T // cp for r in range(cp))


CFG = dict(vocab_size=37, block_size=24, n_layer=2, n_head=2, n_embd=16)
MOE_DROP = dict(CFG, n_expert=4, top_k=2, moe_every=1, capacity_factor=0.5)   # drops assignments
B, STEPS, LR, SEED = 2, 3, 1e-2, 3


def _batches(step, vocab, n):
    rng = np.random.default_rng([7, step])
    t = rng.integers(0, vocab, size=(n, B, CFG["block_size"] + 1))
    return [(x[:, :-1], x[:, 1:]) for x in t]


@pytest.mark.parametrize("model", ["dense", "moe-drop"])
def test_cp_trains_the_single_process_run(comm, model):
    cfg = GPTConfig(**(MOE_DROP if model == "moe-drop" else CFG))
    if CFG["block_size"] % (2 * comm.size):
        pytest.skip(f"block_size {CFG['block_size']} does not split over cp={comm.size}")
    n_micro = 2
    ref = GPT(cfg, seed=SEED, dtype=np.float64)
    opt = AdamW(ref.named_parameters(), lr=LR, weight_decay=0.1)
    want = []
    for s in range(STEPS):
        ref.zero_grad()
        mbs = _batches(s, cfg.vocab_size, n_micro)
        loss = sum(ref.loss_and_grad(x, y, grad_scale=1.0 / n_micro) for x, y in mbs) / n_micro
        want.append((loss, clip_grad_norm(ref.parameters(), 1.0)))
        opt.step(LR)
        ref.moe_stats()
    lay = pympar.layout.Layout(cp=comm.size, n_micro=n_micro)
    opts = SimpleNamespace(seed=SEED, dtype="float32", master_dtype="float64", compress="none", topk_ratio=0.01,
                           bucket_mb=0.01, dp_overlap=True, pp_channels="auto", ep_dispatch="auto", expert_replicas=0,
                           replan_every=20, pp_costs="unit", device="cpu")
    pympar.layout.check(cfg, lay)
    runner = ParallelRunner(cfg, lay, comm, opts, OptimConfig(lr=LR, weight_decay=0.1, grad_clip=1.0))
    got = []
    for s in range(STEPS):
        res = runner.train_step(_batches(s, cfg.vocab_size, n_micro), LR)
        got.append((res.loss, res.grad_norm))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-9)
    full = dict(ref.named_parameters())
    for n, p in runner.named:
        np.testing.assert_allclose(p.data, full[n].data, rtol=1e-9, atol=1e-12, err_msg=n)
    ev = _batches(99, cfg.vocab_size, 2)
    assert abs(runner.eval_loss(ev) - np.mean([ref.forward_loss(x, y) for x, y in ev])) < 1e-9
    for m in runner.mesh.communicators():
        if hasattr(m, "free"):
            m.free()
