"""What a rank of a real layout holds after a training step, and at the step's peak, traced.

tracemalloc sees every buffer NumPy allocates (NumPy reports them in its own trace domain), whoever
keeps it: "held" is the NumPy bytes alive after step 2 (after a garbage collection) that were not
alive before the runner was built; "peak" is tracemalloc's peak over step 2 (every domain: NumPy's
buffers and Python's objects) above what was alive before the runner was built. Neither is a number the code reports about itself. Each is compared
with the ledger's prediction for this rank (pympar.parallel.ledger.predict, the planner's):

- held against the persistent state: parameters, gradient storage (its persistent part) and the
  optimizer's moments. Between steps a rank keeps nothing else of size: the bound is that state
  plus SLACK, where SLACK is a quarter of the smallest full-size weight (an MLP matrix). So a full
  parameter, gradient or moment tensor kept by mistake -- a ZeRO-3 gather not let go, a ZeRO-2
  full gradient, a pipeline stage's activations -- fails, and so does a state that is smaller than
  predicted by more than 10% (a shard missing, the wrong ZeRO stage).
- the step's peak against the ledger's peak (state + activations + communication + workspace) +
  the Python objects the runner keeps + SLACK: the ledger is what the planner plans with, so a step
  that needs more than it says fails. The ledger counts arrays; the runner's own Python objects
  (modules, plans, communicators: ~0.2 MiB, 3% of this tiny model's peak, nothing at a real
  model's) are measured the same way, as the traced bytes outside NumPy's domain kept after the
  step, and added; Python objects that live only during the step stay within SLACK.

Layouts (2 and 4 ranks): ZeRO 0-3 over dp, recomputation none/selective/full, tensor and
pipeline parallelism composed with ZeRO.
"""
import gc
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from pympar.comm import MPIComm
from pympar.layout import Layout, check
from pympar.nn.config import GPTConfig
from pympar.optim import OptimConfig
from pympar.parallel import ledger
from pympar.parallel.runner import ParallelRunner

CFG = GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=4, n_embd=128)
B = 2
SLACK = 128 * 512 * 4 // 4                   # a quarter of an MLP matrix, the smallest full-size weight
LAYOUTS = {
    2: [dict(dp=2, zero=z) for z in (0, 1, 2, 3)] + [dict(dp=2, zero=3, recompute="full"),
                                                      dict(dp=2, zero=1, recompute="selective"),
                                                      dict(tp=2, recompute="selective"), dict(pp=2, n_micro=2)],
    4: [dict(dp=4, zero=z) for z in (0, 2, 3)] + [dict(dp=2, tp=2, zero=3, recompute="full"),
                                                  dict(dp=2, pp=2, zero=2, n_micro=2),
                                                  dict(pp=2, tp=2, zero=1, n_micro=2, schedule="zb-h1")],
}


def numpy_bytes():
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    return sum(t.size for t in snap.traces)


def batches(step, lay, dp_rank):
    rng = np.random.default_rng([7, step])
    toks = rng.integers(0, CFG.vocab_size, size=(lay.dp * lay.n_micro, B, CFG.block_size + 1))
    mine = toks[dp_rank * lay.n_micro:(dp_rank + 1) * lay.n_micro]
    return [(t[:, :-1].copy(), t[:, 1:].copy()) for t in mine]


def measure(world, lay):
    opts = SimpleNamespace(seed=1, dtype="float32", master_dtype="float32",
                           compress="none", topk_ratio=0.01, bucket_mb=25.0, dp_overlap=True, pp_channels="auto", ep_dispatch="auto", expert_replicas=0, replan_every=20,
                           pp_costs="unit", device="cpu")
    gc.collect()
    tracemalloc.start()
    try:
        before, before_all = numpy_bytes(), tracemalloc.get_traced_memory()[0]
        objects_before = before_all - before
        runner = ParallelRunner(CFG, lay, world, opts, OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0))
        for step in range(2):
            data = batches(step, lay, runner.mesh.dp_rank)
            if step == 1:
                gc.collect()
                tracemalloc.reset_peak()
            runner.train_step(data, 1e-3)
            del data
        peak = tracemalloc.get_traced_memory()[1] - before_all
        gc.collect()
        held = numpy_bytes() - before
        objects = tracemalloc.get_traced_memory()[0] - (held + before) - objects_before   # Python objects kept
        pp_rank = runner.mesh.pp_rank
        for c in runner.mesh.communicators():
            if c is not runner.comm and hasattr(c, "free"):
                c.free()
        del runner
    finally:
        tracemalloc.stop()
    want, _ = ledger.predict(CFG, dp=lay.dp, pp=lay.pp, tp=lay.tp, zero=lay.zero, recompute=lay.recompute,
                             micro_batch_size=B, n_micro=lay.n_micro, schedule=lay.schedule, threads=1,
                             pp_rank=pp_rank)
    return held, peak, want, objects


@pytest.fixture(scope="module")
def world(mpi_world):
    return MPIComm(mpi_world, name="world", timeout=60)


def test_what_a_rank_holds_is_the_ledgers(world, mpi_world):
    failures, rows = [], []
    for spec in LAYOUTS.get(world.size, []):
        lay = Layout(micro_batch_size=B, **{"n_micro": 1, **spec})
        check(CFG, lay)
        held, peak, want, objects = measure(world, lay)
        state = want["parameters"] + want["gradients"] - want["gradients_transient"] + want["optimizer"]
        row = (f"[{lay.key()}] rank {world.rank}: held {held / 1024:.0f} KiB, state {state / 1024:.0f} KiB; "
               f"peak {peak / 1024:.0f} KiB, ledger's {want['peak'] / 1024:.0f} KiB + Python objects kept "
               f"{objects / 1024:.0f} KiB")
        rows.append(row)
        if not 0.9 * state <= held <= state + SLACK:
            failures.append("held " + row)
        if not peak <= want["peak"] + objects + SLACK:
            failures.append("peak " + row)
    every = mpi_world.allgather((rows, failures))
    if world.rank == 0:
        print("\n" + "\n".join(r for rs, _ in every for r in rs), flush=True)
    bad = [f for _, fs in every for f in fs]
    assert not bad, "\n".join(bad)
