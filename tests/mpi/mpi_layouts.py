"""The project's central claim, inside every rank of one mpiexec launch: every layout of this
world size (dp x pp x cp x tp, ep | dp*cp) trains the single-process run (docs/design.md, Determinism; issue 5, Proof).

Each rank loops over the layouts of its world size (tests/mpi/layout_cases.py; PYMPAR_LAYOUTS
= ci | full), builds the mesh and ``ParallelRunner`` for the layout, trains STEPS optimiser
steps on the global batch (G micro-batches, rank gets g = dp_rank*n_micro + j; the ranks of a cp
group get the same whole sequences and keep their positions of them) and compares
with the single-process reference that every rank computes locally (nn.GPT accumulating the G
micro-batches, global-norm clipping, AdamW): the loss and the grad norm at every step, every
parameter this rank holds (its shard of the full tensor) after the last step, the evaluation
loss, and a sampled continuation. Relative tolerance 1e-10 in float64 (derived at TOL), 1e-3 in float32 (the
worst float32 layouts, MoE under ZeRO-3 with tensor or context parallelism, differ by up to
2.1e-4 from rounding order alone on an AVX-512 CPU and by 4.1e-4 on an AVX2 Zen one, where
OpenBLAS's sgemm kernels round differently -- the previous 3e-4 failed there on unchanged code;
float64 runs agree to ~1e-13, and a wrong gradient moves parameters by O(1) on this scale).
PYMPAR_LAYOUTS_DEVICE=cuda runs the layouts on GPUs (one per rank, or shared: see
pympar.gpu.nccl_choice) against the same host reference.
Every other pipeline layout runs with the head in chunks of 5 rows (of a micro-batch's 16
tokens), as a 50k vocabulary or a sequence over 1024 tokens makes it: its last stage then runs the
head's forward and backward in F's one pass (pp/executor.py), under every schedule, ZeRO stage and
dp/ep composition the matrix has.
Verdicts are gathered after each layout; the test fails listing each failing layout and the
first quantity that differs.
"""
import contextlib
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from layout_cases import DENSE, G, MOE, all_layouts, ci_layouts
from pympar.backend import to_numpy
from pympar.nn import GPT
from pympar.nn.config import GPTConfig
from pympar.optim import AdamW, OptimConfig, clip_grad_norm
import pympar.layout
from pympar.parallel.runner import ParallelRunner
from pympar.parallel.shard import shard_of

B, T, STEPS, WD, CLIP, SEED = 2, 8, 3, 0.1, 0.5, 5
# bfloat16 (float32 master weights, bf16 activations and products): layouts round at other points
# than the single process (tensor and context parallelism split a product's terms, a row-parallel
# layer rounds each rank's partial product to bf16), and a bf16 ulp is 2^-8 relative, not 2^-24.
# Losses and gradient norms then agree to about 1e-4 in dense models; in MoE models a token whose two
# best experts score within an ulp can take the other one, which moved the step-2 gradient norm by
# up to 4.5e-3 in the CI slices (1-8 ranks): the tolerance is 1e-2. A wrong gradient (sign, shard, a
# missing micro-batch) changes the norm by O(1).
# float64: a layout changes only the order in which terms are summed (products split over tp or cp,
# micro-batches and ranks summed in another grouping); each sum of K terms is then within about K u
# of the other order's (u = 2^-53 ~ 1.1e-16), with K at most a few thousand here and some ten such
# sums chained through a step, so ~1e-12 relative after three steps; AdamW's eps (1e-8) keeps an
# element whose gradient is rounding noise from stepping by ~lr. Observed worst over the full 4- and
# 8-rank matrices: 1.7e-13. The bound 1e-10 leaves two orders of magnitude for other BLAS kernels;
# a wrong gradient is O(1).
TOL = {"float64": 1e-10, "float32": 1e-3, "bfloat16": 1e-2}
# Parameters after three AdamW steps: an element whose gradient is below bf16's resolution of the
# terms summed into it holds rounding noise, which AdamW turns into a step of up to lr either way; the
# bf16 runs take eps = 1e-4 (below) so that noise steps less than signal, and a dense model's
# parameters then agree to 1.4e-2 of their norm (with the one-step floor) at worst in the CI slices.
# In an MoE model the token whose routing tipped (above) trains another expert instead: that expert's
# few rows then differ in kind (up to 0.21 of a bias's norm), so bf16 MoE layouts compare every
# parameter but the experts' (the float32 and float64 layouts of the same slice compare those), within
# 0.1: the tipped token's gradient reaches the layers below it too (up to 4.3e-2 measured). A wrong
# gradient moves parameters by O(lr) per step consistently: O(1) on this scale.
TOL_PARAMS = {("bfloat16", "dense"): 3e-2, ("bfloat16", "moe"): 0.1}
MASTER = {"bfloat16": "float32"}        # the "bfloat16" layouts: float32 master weights, bf16 compute
COMPUTE = {"bfloat16": "bfloat16"}
# AdamW's first steps move each element by about lr * sign(grad): an element whose gradient is
# rounding noise in float32 moves by lr either way, so float32 runs take a smaller lr (a wrong
# gradient still moves parameters by ~lr = 5% of their scale per step)
LR = {"float64": 1e-2, "float32": 1e-3, "bfloat16": 1e-3}
# ... and a larger AdamW eps: an element whose exact gradient is below float32's resolution of
# the terms summed into it (e.g. the attention key bias: zero, softmax being shift-invariant)
# holds rounding noise, which eps = 1e-8 would turn into a step of up to ~lr
EPS = {"float64": 1e-8, "float32": 1e-6, "bfloat16": 1e-4}
MODE = os.environ.get("PYMPAR_LAYOUTS", "ci")
# a developer's selection from the chosen layouts, e.g. "schedule=zb-h1|zb-v;zero=3" (field=values
# separated by |, conditions by ;); the tests in tests/test_layouts.py never set it
WHERE = [(k, v.split("|")) for k, v in (c.split("=", 1) for c in os.environ.get("PYMPAR_LAYOUTS_WHERE", "").split(";")
                                         if c)]
DEVICE = os.environ.get("PYMPAR_LAYOUTS_DEVICE", "cpu")


def cfg_of(model):
    return GPTConfig(**(MOE if model == "moe" else DENSE))


def global_batch(step, vocab):
    rng = np.random.default_rng([23, step])
    toks = rng.integers(0, vocab, size=(G, B, T + 1))
    return [(t[:, :-1], t[:, 1:]) for t in toks]


def eval_batches(vocab, n=3):
    rng = np.random.default_rng(99)
    toks = rng.integers(0, vocab, size=(n, B, T + 1))
    return [(t[:, :-1], t[:, 1:]) for t in toks]


PROMPT = np.array([[1, 2, 3]], np.int64)


def reference(model, dtype, _cache={}):
    """Single process: losses, norms per step, params after STEPS, eval loss, a sample."""
    key = (model, dtype)
    if key not in _cache:
        cfg = cfg_of(model)
        m = GPT(cfg, seed=SEED, dtype=np.dtype(MASTER.get(dtype, dtype)), compute_dtype=COMPUTE.get(dtype))
        opt = AdamW(m.named_parameters(), lr=LR[dtype], weight_decay=WD)
        opt.eps = EPS[dtype]
        losses, norms = [], []
        for s in range(STEPS):
            m.zero_grad()
            mbs = global_batch(s, cfg.vocab_size)
            losses.append(sum(m.loss_and_grad(x, y, grad_scale=1.0 / G) for x, y in mbs) / G)
            norms.append(clip_grad_norm(m.parameters(), CLIP))
            opt.step(LR[dtype])
            m.moe_stats()
        ev = eval_batches(cfg.vocab_size)
        _cache[key] = dict(losses=losses, norms=norms, params={n: p.data.copy() for n, p in m.named_parameters()},
                           eval=float(np.mean([m.forward_loss(x, y) for x, y in ev])),
                           sample=m.generate(PROMPT, 3, top_k=5, rng=np.random.default_rng(1)))
    return _cache[key]


def opts_of(lay):
    return SimpleNamespace(seed=SEED, dtype=COMPUTE.get(lay.dtype, "float32"), master_dtype=MASTER.get(lay.dtype, lay.dtype),
                           compress="none", topk_ratio=0.01, bucket_mb=0.01, dp_overlap=True, pp_channels="auto", ep_dispatch="auto", expert_replicas=0, replan_every=20,
                           pp_costs="measured" if lay.pp > 1 and lay.schedule in ("zb-h1", "zb-v") else "unit", device=DEVICE)


def optim_of(lay):
    return OptimConfig(lr=LR[lay.dtype], weight_decay=WD, grad_clip=CLIP)


WORST = {}                     # dtype -> the largest relative difference seen (reported)
NODE_ROUTES = []               # layouts whose experts dispatched node-aware (PYMPAR_RANKS_PER_NODE set)


def rel(a, b, dtype=None, floor=1e-30):
    """||a - b|| / max(||b||, floor) (Frobenius) in float64.

    Parameters compare with floor = lr * sqrt(size), the length of one AdamW step of every
    element: biases start at zero, and an element whose gradient is (near) zero in exact
    arithmetic -- e.g. the attention key bias, softmax being shift-invariant -- holds rounding
    noise that AdamW turns into steps up to ~lr in either run; a wrong gradient moves elements by
    ~lr per step, i.e. a relative error of order 1 on this scale."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    r = float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), floor)) if b.size else 0.0
    if dtype is not None and np.isfinite(r):
        WORST[dtype] = max(WORST.get(dtype, 0.0), r)
    return r


def first_difference(runner, lay, got):
    """None, or a message naming the first quantity of this rank that differs from the reference."""
    ref, tol = reference(lay.model, lay.dtype), TOL[lay.dtype]
    for s in range(STEPS):                   # in the order they happen: loss, then norm, per step
        for what, key in (("loss", "losses"), ("grad norm", "norms")):
            a, b = got[key][s], ref[key][s]
            if not rel(a, b, lay.dtype) <= tol:
                return f"{what} at step {s}: {a!r} vs single-process {b!r} (rel {rel(a, b):.2e} > {tol})"
    for name, p in runner.named:
        if lay.dtype == "bfloat16" and lay.model == "moe" and ".moe.experts." in name:
            continue
        full = ref["params"][name]
        want = shard_of(p).take(full) if shard_of(p) is not None else full
        got_p = to_numpy(p.data)
        floor = LR[lay.dtype] * np.sqrt(want.size)        # one AdamW step of every element
        if got_p.shape != want.shape or not rel(got_p, want, lay.dtype, floor) <= TOL_PARAMS.get((lay.dtype, lay.model), tol):
            where = f" shard {shard_of(p).index}" if shard_of(p) is not None else ""
            diff = f"rel diff {rel(got_p, want, floor=floor):.2e} > {TOL_PARAMS.get((lay.dtype, lay.model), tol)}" \
                if got_p.shape == want.shape \
                else f"shape {got_p.shape}, expected {want.shape}"
            return f"parameter {name}{where} after {STEPS} steps: {diff}"
    if not rel(got["eval"], ref["eval"], lay.dtype) <= tol:
        return f"eval loss {got['eval']!r} vs single-process {ref['eval']!r}"
    # a sampled token is a discrete choice: bf16's rounding can tip an MoE routing tie and with it the
    # next token's distribution, so bf16 MoE layouts' samples are not compared (dense ones are)
    compare_sample = not (lay.dtype == "bfloat16" and lay.model == "moe")
    if compare_sample and got["sample"] is not None and not np.array_equal(got["sample"], ref["sample"]):
        return f"sample {got['sample'].tolist()} vs single-process {ref['sample'].tolist()}"
    return None


COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "alltoallv", "barrier",
               "iallreduce", "ireduce_scatter", "iallgather", "ibroadcast", "ialltoall", "ialltoallv", "ibarrier")
POINT_TO_POINT = ("send", "recv", "isend", "irecv")


class CountCalls:
    """Counts the collective and point-to-point calls made on each of the given communicators inside
    the ``with`` (instance attributes over their methods, removed on exit): ``calls[i]`` lists the
    names called on ``comms[i]``, in order."""

    def __init__(self, *comms):
        self.comms, self.calls = comms, [[] for _ in comms]

    def __enter__(self):
        for c, calls in zip(self.comms, self.calls):
            for name in COLLECTIVES + POINT_TO_POINT:
                real = getattr(c, name, None)
                if real is not None:
                    setattr(c, name, lambda *a, _n=name, _f=real, _c=calls, **k: (_c.append(_n), _f(*a, **k))[1])
        return self

    def __exit__(self, *exc):
        for c in self.comms:
            for name in COLLECTIVES + POINT_TO_POINT:
                if name in vars(c):
                    delattr(c, name)


def check_group_calls(comm, calls, where):
    """One step's calls on one sub-communicator: a group of one makes none; in a larger group every
    member made the same collectives in the same order (a mismatch would hang or mix buffers on
    another MPI), and the group's sends and receives pair up."""
    if comm.size == 1:
        assert calls == [], (where, comm.name if hasattr(comm, "name") else comm, calls)
        return
    seen = comm.mpi_comm.allgather(calls)
    coll = [[c for c in mine if c in COLLECTIVES] for mine in seen]
    assert all(x == coll[0] for x in coll), (where, getattr(comm, "name", comm), coll)
    sends = sum(c in ("send", "isend") for mine in seen for c in mine)
    recvs = sum(c in ("recv", "irecv") for mine in seen for c in mine)
    assert sends == recvs, (where, getattr(comm, "name", comm), sends, recvs)


def run_layout(world, lay):
    cfg = cfg_of(lay.model)
    pympar.layout.check(cfg, lay, device=DEVICE)                 # the trainer's validation
    runner = ParallelRunner(cfg, lay, world, opts_of(lay), optim_of(lay))
    runner.opt.eps = EPS[lay.dtype]                              # AdamW, or ZeRO's over the kept rows
    got = dict(losses=[], norms=[])
    for s in range(STEPS):
        mbs = global_batch(s, cfg.vocab_size)
        mine = mbs[runner.mesh.dp_rank * lay.n_micro:(runner.mesh.dp_rank + 1) * lay.n_micro]
        subs = [c for c in runner.mesh.communicators() if c is not runner.comm]
        with CountCalls(runner.comm, *subs) as counted:
            res = runner.train_step(mine, LR[lay.dtype])
        # the whole world meets once per step: loss, norm, non-finite count, MoE loads and
        # all-to-all figures, stop and checkpoint flags, memory -- one allreduce of one vector
        assert counted.calls[0] == (["allreduce"] if world.size > 1 else []), (str(lay), s, counted.calls[0])
        for c, calls in zip(subs, counted.calls[1:]):           # and every group within it
            check_group_calls(c, calls, (str(lay), s))
        got["losses"].append(res.loss)
        got["norms"].append(res.grad_norm)
    ev = eval_batches(cfg.vocab_size)
    got["eval"] = runner.eval_loss(ev[runner.mesh.dp_rank::lay.dp])   # unequal counts per dp rank
    got["sample"] = runner.generate(PROMPT, 3, 5, np.random.default_rng(1))
    got["costs"] = runner.executor.costs if runner.executor is not None else None   # zb: step 1's times
    return runner, got


@contextlib.contextmanager
def head_rows(rows):
    """The head's cross-entropy chunks of at most ``rows`` rows inside (None: as configured)."""
    import pympar.nn.gpt as gpt
    kept = gpt.CE_ROWS
    gpt.CE_ROWS = rows or kept
    try:
        yield
    finally:
        gpt.CE_ROWS = kept


def free_mesh(mesh):
    for c in mesh.communicators():
        if hasattr(c, "free"):
            c.free()


@pytest.fixture(scope="module")
def world(mpi_world):
    from pympar.comm import MPIComm

    if DEVICE == "cuda":
        from pympar import gpu

        gpu.select_device(mpi_world)
        return gpu.device_world(mpi_world, timeout=60)
    return MPIComm(mpi_world, name="world", timeout=60)


def test_every_layout_matches_single_process(world, mpi_world):
    layouts = ci_layouts(world.size) if MODE == "ci" else all_layouts(world.size)
    layouts = [lay for lay in layouts if all(str(getattr(lay, k)) in vals for k, vals in WHERE)]
    failures, t0 = [], time.perf_counter()
    n_pp = 0
    for lay in layouts:
        costs = None
        chunked = lay.pp > 1 and n_pp % 2 == 1       # every other pipeline layout: a chunked head
        n_pp += lay.pp > 1
        try:
            with head_rows(5 if chunked else None):
                runner, got = run_layout(world, lay)
            msg, costs = first_difference(runner, lay, got), got["costs"]
            route = getattr(runner.model, "ep_route", None)
            if route is not None:                              # (--ep-dispatch auto across simulated nodes)
                NODE_ROUTES.append(str(lay))
                route.free()
            free_mesh(runner.mesh)
        except Exception as e:                 # noqa: BLE001 -- reported with the layout, below
            msg = f"raised {type(e).__name__}: {e}"
        verdicts = mpi_world.allgather((msg, costs))
        if any(c != verdicts[0][1] for _, c in verdicts):     # --pp-costs measured: one table for the job
            verdicts = [(m or f"zb table costs differ between ranks: {[c for _, c in verdicts]}", c) for m, c in verdicts]
        verdicts = [m for m, _ in verdicts]
        bad = [(r, m) for r, m in enumerate(verdicts) if m is not None]
        if bad:
            failures.append(f"layout [{lay}]{' (chunked head)' if chunked else ''} rank {bad[0][0]}: {bad[0][1]}")
    secs = time.perf_counter() - t0
    if world.rank == 0:
        print(f"\nLAYOUTS world={world.size} mode={MODE} device={DEVICE} ran={len(layouts)} "
              f"failed={len(failures)} seconds={secs:.1f} worst_rel={WORST} node_routes={len(NODE_ROUTES)}", flush=True)
    assert not failures, f"{len(failures)} of {len(layouts)} layouts differ from the single process:\n" + \
        "\n".join(failures[:20])
