"""Data-parallel buckets overlapped with pipeline backward, inside every rank (dp x pp, pp = 2).

The runner's GradSync starts a bucket once its parameters' grads are final: the executor
says when the last micro-batch's backward of each chunk begins (final_backward_hooks ->
begin_final) and notifies each piece (block, ln_f, embedding) as its backward ends; the tied
wte copy's bucket starts after the first/last-stage sum. A probe records, at every bucket
launch, the backward passes each chunk of this rank has begun and ended, whether the tied sum
and the sequence-parallel partial sum are done, whether finish() has begun, and the bucket's
grads; the same layout runs again with the overlap off (every bucket started in finish()). It
checks:
  * no bucket starts before its gradients are final: its chunks' last backward has begun, the
    tied sum is done for the tied copy and the tp sum for partial grads, and the grads at
    launch are bitwise those the overlap-off run holds when finish() begins;
  * every bucket starts before finish() (before this change: all of them started in finish());
  * the launches overlap compute: some bucket starts while this rank still has backward work;
    the tied copy's bucket starts last;
  * losses, grad norms and parameters are bitwise those of the overlap-off run.
Runs at world sizes 4 and 8 (other sizes skip: dp >= 2 and pp = 2 need an even world >= 4).
"""
import numpy as np
import pytest

from layout_cases import G, Layout
from mpi_layouts import LR, free_mesh, global_batch, opts_of, optim_of, cfg_of
from pympar.backend import to_numpy
from pympar.comm import MPIComm
from pympar.parallel.runner import ParallelRunner

STEPS = 2


@pytest.fixture(scope="module")
def world(mpi_world):
    return MPIComm(mpi_world, name="world", timeout=60)


def case(**kw):
    """A pipeline of 2 stages with dp * 2 * tp ranks and the test's G micro-batches."""
    kw = dict(pp=2, micro_batch_size=2, **kw)
    return Layout(n_micro=G // kw["dp"], **kw)


def layouts(n):
    if n < 4 or n % 2:
        return []
    dp = n // 2
    out = [  # (layout, compress)
        (case(dp=dp, schedule="1f1b"), "none"),
        (case(dp=dp, schedule="interleaved", virtual_stages=2, zero=1), "none"),
        (case(dp=dp, ep=2, model="moe", schedule="gpipe"), "none"),
        (case(dp=dp, schedule="interleaved", virtual_stages=2), "fp16"),
    ]
    if n == 8:
        out.append((case(dp=2, tp=2, schedule="1f1b", seq_parallel=True, zero=1), "none"))
    return out


class Probe:
    """Records each bucket launch of the runner's syncs with the pipeline's progress at that moment,
    and every gradient as finish() begins."""

    def __init__(self, runner):
        ex, model = runner.executor, runner.model
        self.model = model
        self.name_of = {id(p): n for n, p in runner.named}
        self.chunk_of = {id(p): c for c, ch in enumerate(model.chunks) for _, p in ch.named_parameters()}
        self.partial = {id(p) for p in (ex.partial_sync.params if ex.partial_sync is not None else [])}
        self.launches = []
        self.reset()
        for c, ch in enumerate(model.chunks):
            ch.stage_backward = self._counting(ch.stage_backward, c)
        ready = model.notify_grad_ready

        def notify_grad_ready(params, **kw):
            if kw.get("final") and any(p is model.tied_weight for p in params):
                self.tied_done = True       # called right after the tied sum
            if kw.get("final") and any(id(p) in self.partial for p in params):
                self.partial_done = True    # called right after the tp sum of partial grads
            ready(params, **kw)
        model.notify_grad_ready = notify_grad_ready
        for d in runner.sync.syncs:
            d._start = self._recording(d._start)
        finish = runner.sync.finish

        def sync_finish():
            self.in_finish = True
            self.at_finish = {n: to_numpy(p.grad).copy() for n, p in runner.named}
            finish()
        runner.sync.finish = sync_finish

    def reset(self):
        self.n_begun = [0] * len(self.model.chunks)
        self.n_done = [0] * len(self.model.chunks)
        self.tied_done = self.partial_done = self.in_finish = False
        self.launches = []

    def _counting(self, backward, c):
        def counted(*a, **k):
            self.n_begun[c] += 1
            out = backward(*a, **k)
            self.n_done[c] += 1
            return out
        return counted

    def _recording(self, start):
        def recorded(b):
            self.launches.append(dict(params=list(b.params), n_begun=list(self.n_begun), n_done=list(self.n_done),
                                      tied_done=self.tied_done, partial_done=self.partial_done,
                                      in_finish=self.in_finish,
                                      grads={self.name_of[id(p)]: to_numpy(p.grad).copy() for p in b.params}))
            return start(b)
        return recorded


def train(world, lay, compress, overlap):
    opts = opts_of(lay)
    opts.compress, opts.dp_overlap = compress, overlap
    cfg = cfg_of(lay.model)
    runner = ParallelRunner(cfg, lay, world, opts, optim_of(lay))
    pr = Probe(runner)
    got = dict(losses=[], norms=[], launches=[], at_finish=[])
    for s in range(STEPS):
        mbs = global_batch(s, cfg.vocab_size)
        mine = mbs[runner.mesh.dp_rank * lay.n_micro:(runner.mesh.dp_rank + 1) * lay.n_micro]
        pr.reset()
        res = runner.train_step(mine, LR[lay.dtype])
        got["losses"].append(res.loss)
        got["norms"].append(res.grad_norm)
        got["launches"].append(pr.launches)
        got["at_finish"].append(pr.at_finish)
    got["params"] = {n: to_numpy(p.data).copy() for n, p in runner.named}
    got["n_buckets"] = sum(len(d.buckets) for d in runner.sync.syncs)
    got["early"] = [d.stats()["last"].get("launched_early", 0) for d in runner.sync.syncs]
    return runner, pr, got


def check_launches(runner, probe, lay, launches, n_buckets, final):
    """final: {name: grad} of the overlap-off run as its finish() began (the final grads)."""
    model, m = runner.model, lay.n_micro
    where = f"rank {runner.comm.rank} (stage {model.rank}) [{lay}]"
    assert len(launches) == n_buckets, f"{where}: {len(launches)} launches, {n_buckets} buckets"
    for rec in launches:
        for p in rec["params"]:
            name = probe.name_of[id(p)]
            if p is model.tied_weight and model.pp > 1:
                assert rec["tied_done"], f"{where}: the tied wte's bucket started before the tied sum"
            elif id(p) in probe.partial:
                assert rec["partial_done"], f"{where}: {name}'s bucket started before the tp sum"
            else:
                c = probe.chunk_of[id(p)]
                assert rec["n_begun"][c] == m, \
                    f"{where}: {name}'s bucket started after {rec['n_begun'][c]} of {m} backwards of chunk {c} began"
            assert np.array_equal(rec["grads"][name], final[name]), f"{where}: {name}'s bucket started before its grad was final"
    late = [rec for rec in launches if rec["in_finish"]]
    assert late == [], f"{where}: {len(late)} of {n_buckets} buckets started only in finish()"
    if lay.tp == 1:                        # (sequence parallelism: every block holds partial grads)
        assert any(sum(r["n_done"]) < m * model.v for r in launches), \
            f"{where}: no bucket started while this rank's backward was still running"
    if model.holds_tied_copy:
        assert any(p is model.tied_weight for p in launches[-1]["params"]), \
            f"{where}: the tied copy's bucket was not the last to start"


def test_dp_buckets_start_during_pipeline_backward(world, mpi_world):
    cases = layouts(world.size)
    if not cases:
        pytest.skip(f"world size {world.size}: dp >= 2 with pp = 2 needs an even world >= 4")
    for lay, compress in cases:
        runner, probe, got = train(world, lay, compress, overlap=True)
        off_runner, _, off = train(world, lay, compress, overlap=False)
        for launches, final in zip(got["launches"], off["at_finish"]):
            check_launches(runner, probe, lay, launches, got["n_buckets"], final)
        assert sum(got["early"]) == got["n_buckets"], (str(lay), got["early"], got["n_buckets"])
        free_mesh(runner.mesh)
        free_mesh(off_runner.mesh)
        assert off["early"] == [0] * len(off["early"]), (str(lay), off["early"])
        where = f"rank {world.rank} [{lay}] compress={compress}"
        assert got["losses"] == off["losses"] and got["norms"] == off["norms"], \
            f"{where}: {got['losses']} {got['norms']} vs overlap off {off['losses']} {off['norms']}"
        for n, a in got["params"].items():
            assert np.array_equal(a, off["params"][n]), f"{where}: {n} differs from the run with the overlap off"
