"""Tensor parallelism inside every rank (tp = world size): TPGPT against the single-process
nn.GPT of the same seed (docs/design.md, Determinism). Holds for any size whose divisors fit the
tiny configs below (1, 2, 4). PYMPAR_TP_SLOW=1 adds the exhaustive matrix."""
import os

import numpy as np
import pytest

from pympar.backend import dtype as backend_dtype
from pympar.nn import GPT, CausalSelfAttention, GPTConfig
from pympar.optim import AdamW, clip_grad_norm
from pympar.parallel.shard import shard_of
from pympar.parallel.gradsync import GradSync
from pympar.parallel.mesh import Mesh
from pympar.parallel.meter import Meter, Tally
from pympar.parallel.tp import TPCollectives, TPGPT, TPCausalSelfAttention, activation_bytes, validate_tp

SLOW = os.environ.get("PYMPAR_TP_SLOW") == "1"
# vocab 37 is prime: never divisible by tp > 1 (padding path); n_head 4: tp in 1, 2, 4
DENSE = dict(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_embd=16)
MOE = dict(DENSE, n_expert=3, top_k=2, moe_every=2)               # block 1 MoE, block 0 dense
MOE_FULL = dict(DENSE, n_expert=4, top_k=2, shared_expert=True, capacity_factor=1.0)
CONFIGS = {"dense": DENSE, "moe": MOE, "moe_full": MOE_FULL}
B, T = 2, 8


class PlainMPI:
    """The three collectives TP uses, straight over mpi4py: PYMPAR_TP_COMM=plain runs these
    tests independently of pympar.comm's algorithms (default: pympar.comm.MPIComm)."""

    def __init__(self, c):
        self.c, self.rank, self.size = c, c.rank, c.size

    def allreduce(self, x, op="sum", algo="auto", inplace=True):
        from mpi4py import MPI
        out = np.empty_like(x)
        self.c.Allreduce(x, out, op={"sum": MPI.SUM, "max": MPI.MAX}[op])
        return out

    def iallreduce(self, x, op="sum"):
        from mpi4py import MPI
        req = self.c.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM)

        class Done:
            def wait(self_):
                req.Wait()
                return x
        return Done()

    def allgather(self, x, algo="auto"):
        out = np.empty((self.size * x.shape[0],) + x.shape[1:], dtype=x.dtype)
        self.c.Allgather(x, out)
        return out

    def reduce_scatter(self, x, op="sum", algo="auto"):
        out = np.empty((x.shape[0] // self.size,) + x.shape[1:], dtype=x.dtype)
        self.c.Reduce_scatter_block(x, out)
        return out

    def barrier(self):
        self.c.Barrier()


@pytest.fixture(scope="module")
def comm(mpi_world):
    if os.environ.get("PYMPAR_TP_COMM") == "plain":
        c = PlainMPI(mpi_world)
    else:
        from pympar.comm import MPIComm
        c = MPIComm(mpi_world)
    return TPCollectives(c, algo=os.environ.get("PYMPAR_TP_ALGO", "auto"))


def batch(step, vocab, g=0):
    rng = np.random.default_rng([5, step, g])
    toks = rng.integers(0, vocab, size=(B, T + 1))
    x, y = toks[:, :-1], toks[:, 1:].copy()
    y[0, 0] = -1                                 # an ignored target
    return x, y


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def check_grads(tpm, ref, rtol, atol=0.0):
    full = dict(ref.named_parameters())
    names = [n for n, _ in tpm.named_parameters()]
    assert names == list(full), "TPGPT lists different parameter names than nn.GPT"
    bad = []
    for n, p in tpm.named_parameters():
        sh = shard_of(p)
        want = full[n].grad if sh is None else sh.take(full[n].grad)
        assert p.grad.shape == want.shape, n
        if not np.allclose(p.grad, want, rtol=rtol, atol=atol):
            bad.append((n, rel(p.grad, want)))
    assert not bad, f"gradients differ from the single process: {bad}"


def _cases():
    base = [("dense", False), ("dense", True), ("moe", False), ("moe", True)]
    return base + ([("moe_full", False), ("moe_full", True)] if SLOW else [])


@pytest.mark.parametrize("cfg,sp", _cases())
def test_loss_logits_and_every_gradient_match(comm, cfg, sp):
    config = GPTConfig(**CONFIGS[cfg])
    ref = GPT(config, seed=7, dtype=np.float64)
    tpm = TPGPT(config, comm, seed=7, dtype=np.float64, sequence_parallel=sp)
    for name, p in tpm.named_parameters():      # every layout starts from the same numbers
        sh = shard_of(p)
        full = dict(ref.named_parameters())[name].data
        np.testing.assert_array_equal(p.data, full if sh is None else sh.take(full), err_msg=name)
    x, y = batch(0, config.vocab_size)
    for g in range(2):                           # two micro-batches: accumulation
        x, y = batch(0, config.vocab_size, g)
        lr_, lt = ref.loss_and_grad(x, y, grad_scale=0.5), tpm.loss_and_grad(x, y, grad_scale=0.5)
        assert abs(lt - lr_) <= 1e-10 * abs(lr_), (lt, lr_)
    check_grads(tpm, ref, rtol=1e-10, atol=1e-14)
    assert rel(tpm.logits(x), ref.logits(x)) < 1e-10
    assert abs(tpm.forward_loss(x, y) - ref.forward_loss(x, y)) <= 1e-10 * abs(ref.forward_loss(x, y))


def _mixed_cases():
    base = [("dense", False, "bfloat16"), ("moe", True, "bfloat16"), ("dense", True, "float16")]
    extra = [("moe", False, "float16"), ("moe_full", True, "bfloat16"), ("dense", False, "float16")]
    return base + (extra if SLOW else [])


@pytest.mark.parametrize("cfg,sp,cdt", _mixed_cases())
def test_mixed_precision_matches_single_process(comm, cfg, sp, cdt):
    """TPGPT with compute_dtype bf16/fp16 against nn.GPT with the same compute_dtype: loss and
    every gradient within the low-precision tolerance of nn's own mixed-precision test, and much
    closer to it than the float32 model is (so the TP run really computes in low precision)."""
    config = GPTConfig(**CONFIGS[cfg])
    ref = GPT(config, seed=7, compute_dtype=cdt)
    f32 = GPT(config, seed=7)
    tpm = TPGPT(config, comm, seed=7, compute_dtype=cdt, sequence_parallel=sp)
    lt = lr_ = l32 = 0.0
    for g in range(2):
        x, y = batch(0, config.vocab_size, g)
        lr_ += ref.loss_and_grad(x, y, grad_scale=0.5)
        l32 += f32.loss_and_grad(x, y, grad_scale=0.5)
        lt += tpm.loss_and_grad(x, y, grad_scale=0.5)
    tol = 5e-2 if cdt == "bfloat16" else 1e-2
    assert abs(lt - lr_) <= tol * abs(lr_), (lt, lr_)
    full, full32 = dict(ref.named_parameters()), dict(f32.named_parameters())
    worst = worst32 = 0.0
    for n, p in tpm.named_parameters():
        sh = shard_of(p)
        assert p.grad.dtype == p.data.dtype == np.float32, n      # float32 master weights and grads
        want = full[n].grad if sh is None else sh.take(full[n].grad)
        w32 = full32[n].grad if sh is None else sh.take(full32[n].grad)
        scale = max(float(np.abs(want).max()), 1e-6)
        d = float(np.abs(p.grad - want).max()) / scale
        assert d < tol, (n, d)
        worst, worst32 = max(worst, d), max(worst32, float(np.abs(w32 - want).max()) / scale)
    assert worst < worst32, (worst, worst32)


def _train(model, comm, steps, dtype, n_micro=2):
    """Single process (comm None): AdamW and clip_grad_norm; TP: the trainer's gradient path
    (GradSync over a dp=1, tp=comm.size mesh: the norm counts tp-replicated grads once)."""
    if comm is None:
        opt, sync = AdamW(model.named_parameters(), lr=1e-2), None
    else:
        sync = GradSync(model.named_parameters(), Mesh(comm.comm, tp=comm.size)).attach(model)   # comm: TPCollectives
        opt = sync.make_optimizer(lr=1e-2)
    losses, norms = [], []
    for s in range(steps):
        model.zero_grad()
        if sync:
            sync.begin_step()
        loss = 0.0
        for g in range(n_micro):
            if sync:
                sync.begin_micro(last=g == n_micro - 1)
            loss += model.loss_and_grad(*batch(s, model.config.vocab_size, g), grad_scale=1.0 / n_micro)
        loss /= n_micro
        if sync:
            sync.finish()
            total_sq = float(np.asarray(comm.allreduce(np.array([sync.local_sq()]))).reshape(-1)[0])
            norms.append(sync.step(opt, 1e-2, 0.5, total_sq))
        else:
            norms.append(clip_grad_norm(model.parameters(), 0.5))
            opt.step()
        model.update_expert_bias()
        losses.append(loss)
    return losses, norms


def _adamw_cases():
    base = [("dense", False, np.float64), ("moe", True, np.float64), ("dense", True, np.float32)]
    extra = [("dense", False, np.float32), ("moe", False, np.float32), ("moe_full", True, np.float64),
             ("moe", True, np.float32)]
    return base + (extra if SLOW else [])


@pytest.mark.parametrize("cfg,sp,dtype", _adamw_cases())
def test_adamw_steps_match(comm, cfg, sp, dtype):
    steps = 4 if SLOW else 3
    config = GPTConfig(**CONFIGS[cfg], bias_update_rate=0.01 if cfg != "dense" else 0.0)
    ref = GPT(config, seed=7, dtype=dtype)
    tpm = TPGPT(config, comm, seed=7, dtype=dtype, sequence_parallel=sp)
    lr_, nr = _train(ref, None, steps, dtype)
    lt, nt = _train(tpm, comm, steps, dtype)
    rtol, atol = (1e-6, 1e-12) if dtype == np.float64 else (1e-4, 1e-6)
    np.testing.assert_allclose(lt, lr_, rtol=rtol)
    np.testing.assert_allclose(nt, nr, rtol=rtol)
    full = dict(ref.named_parameters())
    for n, p in tpm.named_parameters():
        sh = shard_of(p)
        want = full[n].data if sh is None else sh.take(full[n].data)
        got = p.data
        if dtype == np.float32 and n.endswith("attn.c_attn.bias"):
            # the key bias has an exactly zero true gradient (a shift shared by all of a query's
            # scores): its float32 grads are rounding noise that AdamW turns into lr-sized steps in
            # any layout. Its rows (the middle third of the local shard) get a bound of those steps.
            k = got.shape[0] // 3
            assert np.abs(got[k:2 * k] - want[k:2 * k]).max() <= 2 * 1e-2 * steps, n
            got, want = np.r_[got[:k], got[2 * k:]], np.r_[want[:k], want[2 * k:]]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=n)


def test_tp_collectives_per_block_and_timing(comm):
    """Dense, no SP: two allreduces per block in forward and two in backward, plus the embedding
    (1), the cross-entropy statistics (2: max, sums) and the head's input gradient (1)."""
    config = GPTConfig(**DENSE)
    meter = Meter()
    tpm = TPGPT(config, TPCollectives(comm.comm, algo=comm.algo, meter=meter), seed=7, dtype=np.float64)
    assert tpm.tp.meter is meter
    tpm.loss_and_grad(*batch(0, config.vocab_size))
    L = config.n_layer
    want = 0 if comm.size == 1 else 1 + 2 * L + 2 + 1 + 2 * L
    tp = meter.get("tp")
    assert tp.calls == want
    assert (tp.seconds > 0) == (comm.size > 1) and (tp.bytes > 0) == (comm.size > 1)
    assert meter.take().get("tp", Tally()).calls == want
    assert meter.get("tp").calls == 0 and meter.get("tp").seconds == 0.0      # take() reset it


def test_sequence_parallel_saves_activation_memory(comm):
    config = GPTConfig(**dict(DENSE, block_size=16))
    x, y = batch(0, config.vocab_size)
    plain = activation_bytes(TPGPT(config, comm, seed=7, dtype=np.float64), x, y)
    sp = activation_bytes(TPGPT(config, comm, seed=7, dtype=np.float64, sequence_parallel=True), x, y)
    if comm.rank == 0:
        print(f"\n[tp={comm.size}] activation bytes per rank: plain {plain}, sequence parallel {sp} "
              f"({sp / plain:.3f})")
    if comm.size == 1:
        assert sp == plain
    else:
        assert sp < plain


@pytest.mark.parametrize("dtype,cdt", [(np.float64, None), (np.float32, None), (np.float32, "bfloat16")])
def test_attention_computes_the_single_process_numbers(comm, dtype, cdt):
    """TPCausalSelfAttention runs nn's attention core on its local heads: the core gives a rank's
    heads bit for bit the numbers it gives them among all heads, and the TP attention output before
    c_proj (ctx[-1], (B, T, nhl*hs)) equals nn.CausalSelfAttention's for this rank's heads -- to the
    dtype's rounding, since the column-parallel c_attn is a GEMM over a slice of the weight's
    columns and a BLAS may round a narrower product differently (OpenBLAS's sgemm does on an AVX2
    Zen CPU, at 36 of 72 columns); at tp=1 y, dx and every gradient are bitwise."""
    C, nh = 24, 4                                           # head size 6: 1/sqrt(6) rounds (a power of 2 would not)
    rng = np.random.default_rng(11)
    act = dtype if cdt is None else backend_dtype(cdt)      # activations arrive in the compute dtype
    x = rng.standard_normal((B, T, C)).astype(act)
    dy = rng.standard_normal((B, T, C)).astype(act)
    ref = CausalSelfAttention(C, nh, name="a", seed=3, dtype=dtype, compute_dtype=cdt)
    tpm = TPCausalSelfAttention(C, nh, comm, name="a", seed=3, dtype=dtype, compute_dtype=cdt)
    y_ref, ctx_ref = ref.forward(x)
    y, ctx = tpm.forward(x)
    local = C // comm.size                                  # this rank's heads' columns of ya
    ya_ref = ctx_ref[-1][..., comm.rank * local:(comm.rank + 1) * local]
    nhl = nh // comm.size
    qkv_ref, _ = ref.c_attn.forward(x)                      # the full qkv, the rank's heads taken
    mine = qkv_ref.reshape(B, T, 3, nh, C // nh)[:, :, :, comm.rank * nhl:(comm.rank + 1) * nhl]
    np.testing.assert_array_equal(tpm.core.forward(np.ascontiguousarray(mine))[0], ya_ref)
    tol = {np.float64: 1e-12, np.float32: 1e-5}.get(dtype if cdt is None else None, 1e-2)
    np.testing.assert_allclose(ctx[-1].astype(np.float64), ya_ref.astype(np.float64), rtol=tol, atol=tol)
    dx_ref, dx = ref.backward(dy, ctx_ref), tpm.backward(dy, ctx)
    if comm.size == 1:
        np.testing.assert_array_equal(y, y_ref)
        np.testing.assert_array_equal(dx, dx_ref)
        for (n, p), (_, q) in zip(tpm.named_parameters(), ref.named_parameters()):
            np.testing.assert_array_equal(p.grad, q.grad, err_msg=n)


def test_generate_matches(comm):
    config = GPTConfig(**DENSE)
    ref = GPT(config, seed=7, dtype=np.float64)
    tpm = TPGPT(config, comm, seed=7, dtype=np.float64, sequence_parallel=True)
    prompt = np.array([[1, 2, 3]])
    a = ref.generate(prompt, 6, top_k=5, rng=np.random.default_rng(1))
    b = tpm.generate(prompt, 6, top_k=5, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(a, b)


def test_invalid_layout_raises_the_same_error_everywhere(comm):
    bad = GPTConfig(**dict(DENSE, n_head=3, n_embd=24))
    if comm.size in (2, 4):
        with pytest.raises(ValueError, match=f"n_head=3 is not divisible by tp={comm.size}"):
            TPGPT(bad, comm, seed=0, dtype=np.float64)
    with pytest.raises(ValueError, match="n_head=3 is not divisible by tp=2"):
        validate_tp(bad, 2)
    if comm.size > 1:
        tpm = TPGPT(GPTConfig(**DENSE), comm, seed=0, dtype=np.float64, sequence_parallel=True)
        odd = np.zeros((1, comm.size + 1), dtype=np.int64)
        with pytest.raises(ValueError, match="not divisible by tp"):
            tpm.loss_and_grad(odd, odd)
    comm.comm.barrier()                          # nobody is left inside a collective
