"""Data parallelism inside every rank: DataParallel (bucketed, overlapped, ZeRO-1) against the
single-process run of the same global batch (docs/design.md, Determinism). Holds for any size."""
import numpy as np
import pytest

from dp_cases import LR, MOE, TINY, Counting, dp_communicator, run_dp, run_single

from pympar.parallel.dp import DataParallel

STEPS = 3


@pytest.fixture(scope="module")
def comm(mpi_world):
    return dp_communicator(mpi_world)


def _key_bias_noise(name, got, want, dtype, shard=None):
    """float32: the key bias has an exactly zero true gradient (softmax ignores a shift shared by
    a query's scores), so its grads are rounding noise that AdamW turns into lr-sized steps in
    any layout. Its slice is only checked to stay within those steps; the rest stays strict.
    ``shard`` (ZeRO-3): got and want are this rank's elements of the full bias."""
    if dtype != np.float32 or not name.endswith("attn.c_attn.bias"):
        return got, want
    n = shard.full_shape[0] if shard is not None else want.shape[0]
    key = np.zeros(n, dtype=bool)
    key[n // 3:2 * n // 3] = True
    if shard is not None:
        key = shard.take(key)
    if key.any():
        assert np.abs(got[key] - want[key]).max() <= 2 * LR * STEPS, name
    return got[~key], want[~key]


def _check_same(ref, got, dtype):
    """float64: every element to rel 1e-6. float32: each tensor to rel 1e-4 in norm (AdamW divides
    by sqrt(v), so an element whose gradient is near zero turns float32 rounding of the summation
    order into a visible step; the tensor as a whole still agrees to 1e-4)."""
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6 if dtype == np.float64 else 1e-5)
    np.testing.assert_allclose(got["norms"], ref["norms"], rtol=1e-6 if dtype == np.float64 else 1e-4)
    assert got["params"].keys() == ref["params"].keys()
    want = {n: (w if got["shards"][n] is None else got["shards"][n].take(w)) for n, w in ref["params"].items()}
    pairs = {n: _key_bias_noise(n, got["params"][n], w, dtype, got["shards"][n]) for n, w in want.items()}
    if dtype == np.float64:
        bad = [n for n, (g, w) in pairs.items() if not np.allclose(g, w, rtol=1e-6, atol=1e-10)]
        for n in bad:
            np.testing.assert_allclose(pairs[n][0], pairs[n][1], rtol=1e-6, atol=1e-10,
                                       err_msg=f"{n} (all differing: {bad})")
    else:
        rel = {n: float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-12)) for n, (g, w) in pairs.items()}
        bad = {n: r for n, r in rel.items() if r > 1e-4}
        assert not bad, f"float32 tensors differing by more than rel 1e-4 in norm: {bad}"


CASES = [  # (cfg, dtype, bucket_mb, overlap, zero)
    ("dense", np.float64, 0.002, True, False),
    ("dense", np.float64, 1000.0, False, False),
    ("dense", np.float32, 0.01, True, True),
    ("moe", np.float64, 0.004, True, True),
    ("moe", np.float32, 0.002, False, False),
    ("dense", np.float64, 0.002, True, 2),
    ("moe", np.float64, 0.004, True, 3),
    ("dense", np.float32, 0.01, False, 3),
]


@pytest.mark.parametrize("cfg,dtype,bucket_mb,overlap,zero", CASES)
def test_dp_matches_single_process(comm, cfg, dtype, bucket_mb, overlap, zero):
    cfg = TINY if cfg == "dense" else MOE
    n_micro = 2
    ref = run_single(cfg, dtype, n_micro * comm.size, STEPS)
    got = run_dp(comm, cfg, dtype, n_micro, STEPS, bucket_mb=bucket_mb, overlap=overlap, zero=zero)
    _check_same(ref, got, dtype)


def test_accumulation_syncs_only_on_last_micro_batch(comm):
    counting = Counting(comm)
    n_micro = 3
    got = run_dp(counting, TINY, np.float64, n_micro, 1, bucket_mb=0.002, overlap=True, zero=False)
    dp = got["dp"]
    if comm.size == 1:
        assert [c for c in counting.calls if c[1] != "step"] == [] and dp.stats()["last"]["collectives"] == 0
        return
    phases = [ph for _, ph in counting.calls if ph.startswith("micro")]
    # nothing while accumulating; on the last micro-batch (or in finish) one allreduce per bucket
    assert all(ph in (f"micro {n_micro - 1}", "finish", "step") for ph in phases + [p for _, p in counting.calls]), counting.calls
    early = [k for k, ph in counting.calls if ph in [f"micro {j}" for j in range(n_micro - 1)]]
    assert early == [], counting.calls
    assert len([k for k, _ in counting.calls if k == "iallreduce"]) == len(dp.buckets), counting.calls
    assert dp.stats()["last"]["collectives"] == len(dp.buckets)


def test_zero2_syncs_every_micro_batch_and_frees_the_full_gradients(comm):
    """ZeRO-2 reduce-scatters each bucket as soon as a micro-batch's backward completes it (the
    full-size gradient must not persist across micro-batches): one per bucket per micro-batch."""
    if comm.size == 1:
        pytest.skip("no collectives at dp=1")
    counting = Counting(comm)
    n_micro = 3
    got = run_dp(counting, TINY, np.float64, n_micro, 1, bucket_mb=0.002, overlap=True, zero=2)
    dp = got["dp"]
    for j in range(n_micro):
        started = [k for k, ph in counting.calls if k == "ireduce_scatter" and ph == f"micro {j}"]
        assert len(started) >= len(dp.buckets) - 1, (j, counting.calls)
    # the tied wte's bucket, when wte is alone in it, syncs twice: the head's share as soon as the
    # head's backward is done (its full gradient then need not wait for the embedding), then the rest
    wte_alone = any(b.names == ["transformer.wte.weight"] for b in dp.buckets)
    assert len([k for k, _ in counting.calls if k == "ireduce_scatter"]) == n_micro * (len(dp.buckets) + wte_alone)


@pytest.mark.parametrize("overlap,zero", [(True, False), (False, False), (True, True)])
def test_overlap_starts_buckets_during_backward(comm, overlap, zero):
    """Plain DP's allreduce and ZeRO-1's reduce-scatter: each bucket's NONBLOCKING collective
    starts in backward as soon as its grads are final (overlap), else all of them in finish."""
    if comm.size == 1:
        pytest.skip("no collectives at dp=1")
    counting = Counting(comm)
    got = run_dp(counting, TINY, np.float32, 1, 1, bucket_mb=0.002, overlap=overlap, zero=zero)
    n_buckets = len(got["dp"].buckets)
    assert n_buckets >= 4
    verb = "ireduce_scatter" if zero else "iallreduce"
    blocking = [k for k, ph in counting.calls if k == verb[1:] and ph in ("micro 0", "finish")]
    assert blocking == [], f"buckets synced with the blocking {verb[1:]}"
    early = [k for k, ph in counting.calls if k == verb and ph == "micro 0"]
    late = [k for k, ph in counting.calls if k == verb and ph == "finish"]
    if overlap:
        # every bucket but the embedding's (finished at the very end of backward) starts early
        assert len(early) >= n_buckets - 1 and len(early) + len(late) == n_buckets
    else:
        assert early == [] and len(late) == n_buckets


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_keeps_only_its_rows(comm, zero):
    """Every array the optimizer and the gradient sync hold after a step, counted per rank: m and
    v of this rank's rows only (every element on exactly one rank); from ZeRO-2 no full gradient
    survives the sync, only the reduced rows; ZeRO-3 parameters are rows too. Fails if a stage
    keeps a full-size buffer it should not."""
    from dp_cases import _model, global_batch

    model, _ = _model(TINY, np.float32)
    named = list(model.named_parameters())
    n = sum(int(np.prod(p.shape)) for _, p in named)
    dp = DataParallel(named, comm, bucket_mb=0.002, zero=zero).attach(model)
    opt = dp.make_optimizer(lr=1e-3)
    (x, y), = global_batch(0, comm.size)[comm.rank:comm.rank + 1]
    model.zero_grad()
    dp.begin_micro(last=True)
    model.loss_and_grad(x, y)
    dp.finish()
    dp.step(opt, clip=0.5)
    kept = sum(int(np.prod(w.shape)) for _, w, _, _, _ in opt.pieces)
    assert opt.state_bytes() == 2 * 4 * kept
    assert int(np.asarray(comm.allreduce(np.array([kept]))).reshape(-1)[0]) == n
    assert kept <= -(-n // comm.size) + sum(len(b.params) for b in dp.buckets)   # rows, rounding aside
    own = sum(b.persistent_bytes for b in dp.buckets) // 4      # reduced-gradient storage of its own
    if zero == 1:
        assert own == 0                                          # the reduced rows live in the full gradient
    else:
        assert own < n / comm.size + sum(len(b.params) for b in dp.buckets) * 64   # rows + padding
    full_grads = sum(p.grad.size for _, p in named if p.has_grad)
    assert full_grads == (n if zero == 1 else 0), (zero, full_grads)
    held = sum(p.data.size for _, p in named)
    assert held == (kept if zero == 3 else n)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_state_is_pieces_of_adamws_and_resumes(comm, zero):
    """ZeRO's m, v rows, put where their Shards say, are plain DP's AdamW state; a fresh ZeRO run
    loaded from (parameters, those pieces) takes the same next step as the uninterrupted one."""
    from dp_cases import LR, _model, global_batch

    def steps(model, opt, dp, first, last):
        for s in range(first, last):
            model.zero_grad()
            (x, y), = global_batch(s, comm.size)[comm.rank:comm.rank + 1]
            dp.begin_micro(last=True)
            model.loss_and_grad(x, y)
            dp.finish()
            dp.step(opt, clip=0.5)

    def full_state(model, opt):
        """(full params, full m, full v) on every rank, from every rank's pieces."""
        mine = {n: (p.data.copy(), p.shard) for n, p in model.named_parameters()}
        shards, _ = opt.checkpoint_shards()
        out = [{}, {}, {}]
        for part in comm_allgather(mine, {k: (a.copy(), sh) for k, (a, sh) in shards.items()}):
            for which, d in enumerate(part):
                for k, (a, sh) in d.items():
                    i = which if which == 0 else (1 if k.startswith("m.") else 2)
                    key = k if which == 0 else k.split(".", 1)[1]
                    full_shape = sh.full_shape if sh is not None else a.shape
                    dst = out[i].setdefault(key, np.zeros(full_shape))
                    if sh is None:
                        dst[...] = a
                    else:
                        sh.put(dst, a)
        return out

    def comm_allgather(*objs):
        from mpi4py import MPI
        return MPI.COMM_WORLD.allgather(objs)

    ref_model, ref_opt = _model(TINY, np.float64)
    steps(ref_model, ref_opt, DataParallel(ref_model.named_parameters(), comm, bucket_mb=0.004).attach(ref_model), 0, 2)
    model, _ = _model(TINY, np.float64)
    dp = DataParallel(model.named_parameters(), comm, bucket_mb=0.004, zero=zero).attach(model)
    opt = dp.make_optimizer(lr=LR)
    steps(model, opt, dp, 0, 2)
    params, m, v = full_state(model, opt)
    assert opt.step_count == ref_opt.step_count == 2
    for n in ref_opt.m:
        np.testing.assert_allclose(m[n], ref_opt.m[n], rtol=1e-6, atol=1e-12, err_msg=n)
        np.testing.assert_allclose(v[n], ref_opt.v[n], rtol=1e-6, atol=1e-14, err_msg=n)
    # resume: a fresh model and ZeRO optimizer from the full state (each rank takes its pieces)
    model2, _ = _model(TINY, np.float64)
    model2.load_state_dict(params)
    dp2 = DataParallel(model2.named_parameters(), comm, bucket_mb=0.004, zero=zero).attach(model2)
    opt2 = dp2.make_optimizer(lr=LR)
    shards, _ = opt2.checkpoint_shards()
    opt2.load_checkpoint_shards({k: sh.take((m if k.startswith("m.") else v)[k.split(".", 1)[1]])
                                 for k, (_, sh) in shards.items()}, {"step": 2})
    steps(model, opt, dp, 2, 3)
    steps(model2, opt2, dp2, 2, 3)
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        np.testing.assert_array_equal(q.data, p.data, err_msg=n)
