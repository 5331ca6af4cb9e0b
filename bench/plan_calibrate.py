"""Machine constants for pympar.plan's CPU model, from microbenchmarks that are not the
layouts the planner ranks (bench/plan_accuracy.py ranks those; nothing here sees them).

  single process   bench/plan_accuracy.py's worker on 1 rank, layout dp1 pp1 tp1 with m
                   micro-batches of B sequences, (B, m) in --shapes; the least-squares plane
                   t = step_fixed + m * micro_fixed + m * B * per_seq gives the cost of a step
                   outside the micro-batches (optimiser, gradient zeroing, loss bookkeeping),
                   the fixed cost of one micro-batch through the model (Python dispatch of
                   every op, independent of B) and one sequence's forward + backward on one
                   core. The matmul peak of the same process (best of short bursts, in the
                   dtype the steps compute in: --dtype auto's) is kept
                   with them: per_seq minus the matmul FLOPs at that rate is the non-matmul
                   (elementwise, softmax, layernorm) time.
  allreduce        ``mpiexec -n k python -m pympar.bench allreduce --algo auto`` at each rank
                   count k of --world (the ranks oversubscribe the cores exactly as the
                   layouts' ranks do): alpha = the time of the smallest message, the latency a
                   tensor-parallel allreduce of a few KiB pays; busbw at >= 1 MiB.
  contention       at each rank count k of --world, k copies of the single-process run (B x m:
                   the middle of --shapes by B * m) at once: one mpiexec of k ranks, each stepping its own
                   model (plan_accuracy.py's worker --alone), a barrier before the timed steps;
                   slowdown = their median step / the median of the run alone. The planner's
                   rank on a node with more ranks than cores computes this much slower
                   (Machine.oversubscription); without it, ranks / cores. Measured 2026-12-08 on
                   the 2-core VM in three calibrations: 2.05-2.29 at 4 copies, 4.19-5.32 at 8
                   (the first two of a 1 x 1 step; bench/results/plan_accuracy.json: 2.24 and
                   4.19 of 1 x 4, four micro-batches of one sequence), against 2 and 4: each core's caches are shared by the ranks it switches between.
  arrival spread   at each rank count k of --world, every rank loops over a burst of compute
                   (a (2048, 128) x (128, 96) product, tanh, a scale and a row sum, repeated:
                   the mix of a layer's pieces, not a layer) with and without a 4 KiB allreduce
                   after each burst; spread = (burst + allreduce) - burst - the allreduce alone
                   in a tight loop, at bursts of 1-16 repeats. Where ranks outnumber cores, a
                   rank reaches a collective while a peer still waits for its share of a core,
                   and the time until the last one arrives grows with the burst up to a
                   scheduler slice (bench/results/plan_accuracy.json, 2026-12-08, 4 ranks on 2
                   cores: 0.14 ms after bursts of 1.4 ms, 0.55 after 5.6, 1.11 after 11, 1.29
                   after 23; 8 ranks: 2.4 after 3.1 ms, 4.2 after 24): the tight loop, where every
                   rank is inside the collective, does not see it. The planner adds it to each
                   tensor- and expert-parallel collective (Machine.arrival).
Rounds are interleaved and each number is the median over them.

    python bench/plan_calibrate.py --world 4,8 --json bench/results/plan_calibration.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

sys.path.insert(0, str(common.ROOT))
from pympar.layout import Layout  # noqa: E402
from pympar.plan.cli import fit_alpha_beta  # noqa: E402


def single_step(preset: str, mbs: int, n_micro: int, steps: int, timeout: float) -> float:
    """Median step time of one process, ``n_micro`` micro-batches of ``mbs`` sequences."""
    import plan_accuracy

    return plan_accuracy.measure(1, Layout(dp=1, pp=1, tp=1, ep=1, micro_batch_size=mbs, n_micro=n_micro, schedule="1f1b"), preset, steps, timeout)[0]["step_s"]


def allreduce_json(world: int, out: Path, timeout: float) -> Path:
    p = common.launch(world, ["-m", "pympar.bench", "allreduce", "-b", "8", "-e", "8M", "-f", "16", "-n", "40",
                              "-w", "5", "--algo", "auto", "--no-torch", "--json", str(out)], timeout)
    if p.returncode:
        raise RuntimeError(f"pympar.bench allreduce -n {world} failed ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    return out


def concurrent_steps(preset: str, mbs: int, n_micro: int, k: int, steps: int, timeout: float) -> list:
    """Median step times of ``k`` one-process runs at once: one mpiexec of k ranks, each stepping
    its own copy of the model, timed after a common barrier."""
    import plan_accuracy

    lay = Layout(dp=1, pp=1, tp=1, ep=1, micro_batch_size=mbs, n_micro=n_micro, schedule="1f1b")
    return [r["step_s"] for r in plan_accuracy.measure(k, lay, preset, steps, timeout, alone=True)]


SYNC_REPEATS = (1, 2, 4, 8, 16)


def sync_worker() -> None:
    """One rank of the arrival-spread microbenchmark: prints "SYNC [[burst_s, spread_s], ...]" on rank 0."""
    import time

    import numpy as np
    from mpi4py import MPI

    from pympar.comm import MPIComm

    comm = MPIComm(MPI.COMM_WORLD)
    rng = np.random.default_rng(comm.rank)
    a, b = rng.random((2048, 128), np.float32), rng.random((128, 96), np.float32)
    x, y = np.ones(1024, np.float32), np.empty(1024, np.float32)

    def loop(k, reps, coll):
        comm.barrier()
        t = time.perf_counter()
        for _ in range(k):
            for _ in range(reps):
                h = np.tanh(a @ b)
                h *= 0.5
                h.sum(axis=1)
            if coll:
                comm.allreduce(x, out=y)
        return (time.perf_counter() - t) / k

    alone = []
    out = []
    for reps in SYNC_REPEATS:
        k = max(8, 96 // reps)
        loop(2, reps, True), loop(2, reps, False)            # warm: auto's choice, the caches
        c, ca = [], []
        for _ in range(5):                                     # alternating: the same minutes
            c.append(loop(k, reps, False))
            ca.append(loop(k, reps, True))
            alone.append(loop(100, 0, True))
        out.append((float(np.median(c)), float(np.median(ca) - np.median(c))))
    a0 = float(np.median(alone))
    if comm.rank == 0:
        print("SYNC " + json.dumps([[c, max(0.0, e - a0)] for c, e in out]), flush=True)


def sync_spread(world: int, timeout: float) -> list:
    """[[burst_s, spread_s], ...] of ``world`` ranks (sync_worker)."""
    p = common.launch(world, [__file__, "--sync-worker"], timeout)
    lines = [x for x in p.stdout.splitlines() if x.startswith("SYNC ")]
    if p.returncode or not lines:
        raise RuntimeError(f"the arrival-spread benchmark at {world} ranks failed ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    return json.loads(lines[-1][5:])


def plane_fit(shapes, ys) -> tuple:
    """Least squares t = a + m b + m B c over (B, m) shapes -> (a, b, c)."""
    import numpy as np

    X = np.array([[1.0, m, m * B] for B, m in shapes])
    coef = np.linalg.lstsq(X, np.array(ys), rcond=None)[0]
    return tuple(float(c) for c in coef)


class Calibration:
    """Rounds of the microbenchmarks, measured one round at a time so that a caller can
    interleave them with other runs (bench/plan_accuracy.py puts one before each round of its
    layouts: the machine's load drifts, and the constants must be those of the same minutes)."""

    def __init__(self, preset: str, worlds, shapes, steps: int, timeout: float):
        self.preset, self.worlds, self.shapes, self.steps, self.timeout = preset, list(worlds), list(shapes), steps, timeout
        self.step = {s: [] for s in self.shapes}
        self.peaks, self.coll = [], {w: [] for w in self.worlds}
        self.sync = {w: [] for w in self.worlds}
        self.contention = {w: [] for w in self.worlds}
        # the copies' shape: the middle of the shapes by sequences per step (a step of one sequence
        # is mostly fixed cost; one of 16 takes 8 copies seconds)
        self.contention_shape = sorted(self.shapes, key=lambda s: s[0] * s[1])[(len(self.shapes) - 1) // 2]
        from pympar.kernels import gemm
        self.dtype = "bfloat16" if gemm.bf16_native() else "float32"   # the steps' --dtype auto (config.resolve_dtype)
        self._tmp = tempfile.TemporaryDirectory()

    def round(self, worlds=None) -> None:
        from pympar.metrics import measure_cpu_peak

        k = len(self.peaks)
        self.peaks.append(max(measure_cpu_peak(self.dtype, seconds=0.05) for _ in range(6)))
        for B, m in self.shapes:
            self.step[(B, m)].append(single_step(self.preset, B, m, self.steps, self.timeout))
        for w in worlds or self.worlds:
            self.coll[w].append(fit_alpha_beta([allreduce_json(w, Path(self._tmp.name) / f"ar{w}_{k}.json", self.timeout)]))
            self.sync[w].append(sync_spread(w, self.timeout))
            self.contention[w].append(statistics.median(concurrent_steps(self.preset, *self.contention_shape, w,
                                                                          self.steps, self.timeout)))

    def result(self) -> dict:
        """Medians over the rounds and the fitted plane (the JSON pympar.plan --calibration reads)."""
        med = {s: statistics.median(v) for s, v in self.step.items()}
        step_fixed, micro_fixed, per_seq = plane_fit(self.shapes, [med[s] for s in self.shapes])
        name = {s: f"{s[0]}x{s[1]}" for s in self.shapes}
        return dict(kind="plan_calibration", machine=common.machine(), preset=self.preset, rounds=len(self.peaks),
                    matmul_peak=statistics.median(self.peaks), matmul_peak_rounds=self.peaks, matmul_dtype=self.dtype,
                    single_process=dict(shapes=[name[s] for s in self.shapes], step_s={name[s]: med[s] for s in self.shapes},
                                        rounds={name[s]: self.step[s] for s in self.shapes},
                                        step_fixed_s=step_fixed, micro_fixed_s=micro_fixed, per_seq_s=per_seq),
                    allreduce={str(w): dict(alpha_s=statistics.median(x[0] for x in c), busbw=statistics.median(x[1] for x in c),
                                            rounds=c) for w, c in self.coll.items() if c},
                    arrival={str(w): dict(points=[[statistics.median(r[i][0] for r in c), statistics.median(r[i][1] for r in c)]
                                                  for i in range(len(SYNC_REPEATS))], rounds=c)
                             for w, c in self.sync.items() if c},
                    contention={str(w): dict(slowdown=statistics.median(c) / med[self.contention_shape], step_s=c,
                                             shape=name[self.contention_shape])
                                for w, c in self.contention.items() if c})


def parse_shapes(text: str) -> list:
    return [tuple(int(v) for v in x.split("x")) for x in text.split(",")]


def run(a) -> dict:
    cal = Calibration(a.preset, [int(x) for x in a.world.split(",")], parse_shapes(a.shapes), a.steps, a.timeout)
    for _ in range(a.rounds):                             # interleaved: the load drifts
        cal.round()
    res = cal.result()
    print(json.dumps({k: res[k] for k in ("matmul_peak", "single_process", "allreduce", "arrival", "contention")}, indent=1), flush=True)
    return res


def plot(res: dict, png) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    sp = res["single_process"]
    shapes = [tuple(int(v) for v in s.split("x")) for s in sp["shapes"]]
    fit = [sp["step_fixed_s"] + m * sp["micro_fixed_s"] + m * B * sp["per_seq_s"] for B, m in shapes]
    ax.plot([sp["step_s"][s] * 1e3 for s in sp["shapes"]], [f * 1e3 for f in fit], "o")
    for s, f in zip(sp["shapes"], fit):
        ax.annotate(f"B x m = {s}", (sp["step_s"][s] * 1e3, f * 1e3), fontsize=6)
    lim = max(ax.get_xlim()[1], ax.get_ylim()[1])
    ax.plot([0, lim], [0, lim], "k:", lw=0.6)
    ax.set(xlabel="measured single-process step (ms, median)",
           ylabel=f"fit {sp['step_fixed_s'] * 1e3:.1f} + m {sp['micro_fixed_s'] * 1e3:.1f} + mB {sp['per_seq_s'] * 1e3:.2f} ms",
           title=f"planner calibration, preset {res['preset']}")
    ax.legend(fontsize=7)
    common.save(fig, png)


def main(argv=None):
    if "--sync-worker" in (sys.argv[1:] if argv is None else argv):
        return sync_worker()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="4,8", help="rank counts whose allreduce, compute slowdown and arrival spread to measure")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--shapes", default="1x1,4x1,16x1,1x4,4x4", help="BxM: micro-batch size x count of the single-process steps")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per single-process run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    common.run_and_write(ap, sys.argv[1:] if argv is None else argv, "plan_calibration", run, plot)


if __name__ == "__main__":
    main()
