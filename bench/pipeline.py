"""Measured pipeline bubble per schedule against the formula (p-1)/(m+p-1), (p-1)/(v*m+p-1),
and for zb-h1 (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) with the F, B, W times measured in the run.

Each rank's bubble is 1 - (its time in forward/backward) / (step time up to the loss
reduction), from pympar.parallel.pp.PipelineExecutor's own counters; the table shows the mean
and the worst rank, median over the timed steps.

The blocks' compute is emulated so that every block costs the same and compute dominates:
  --work spin   each block forward spins (busy-waits, no sleep) a fixed wall time, backward
                twice that. Wall-time fixed, so the numbers survive oversubscription
                (4 ranks on 2 cores) — this measures the schedule and the messaging, not GEMMs.
  --work sleep  the same durations by time.sleep: a rank that "computes" leaves the cores to the
                others, so on a loaded or oversubscribed machine this isolates the schedule's
                own bubble plus the message latency (the fairest emulation on 2 cores).
  --work flops  each block forward runs a fixed number of (64x64) matmuls, backward twice as
                many: real CPU work; on fewer cores than ranks, contention distorts it.
  --work model  real GPT blocks (pympar.nn) of --embd width: the true thing, same caveat.
The embedding and head are real pympar.nn modules (tiny vocabulary, so cheap). Each rank takes its
share of the node's cores (pympar.parallel.cores; --launch sets one thread per rank).

    python bench/pipeline.py --launch --pp 2,4 --json bench/pipeline.json      # spawns mpiexec
    mpiexec -n 4 python bench/pipeline.py --m 4,8,16 --json out.json          # one p
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", action="store_true", help="run mpiexec -n p for every --pp and merge")
    ap.add_argument("--pp", default="2,4", help="pipeline sizes for --launch")
    ap.add_argument("--m", default="4,8,16", help="micro-batch counts")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb-h1,zb-v,dualpipev")
    ap.add_argument("--v", type=int, default=2, help="chunks per rank for interleaved")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--work", choices=("spin", "sleep", "flops", "model"), default="spin")
    ap.add_argument("--block-ms", type=float, default=2.0, help="forward time per block (spin, sleep)")
    ap.add_argument("--reps", type=int, default=40, help="64x64 matmuls per block forward (flops)")
    ap.add_argument("--embd", type=int, default=128, help="width of the real blocks (model)")
    ap.add_argument("--costs", default="unit",
                    help="zb-h1/zb-v tables, comma-separated: 'unit' (unit-time F, B, W) and/or 'measured' (for "
                         "the times the first, warm-up, step measured per stage, as --pp-costs measured)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default="")
    return ap.parse_args(argv)


def ints(s):
    return [int(x) for x in s.split(",") if x]


# --- emulated blocks ------------------------------------------------------------------------
class SpinBlock:
    """Forward: busy-wait ``t`` seconds; backward: 2t, of which t is the weight-gradient part
    (deferred to the W pass by the zero-bubble schedules, at once otherwise). Identity."""

    def __init__(self, t):
        self.t = t

    @staticmethod
    def _spin(t):
        end = time.perf_counter() + t
        while time.perf_counter() < end:
            pass

    def forward(self, x):
        self._spin(self.t)
        return x, None

    def backward(self, dy, ctx, daux=1.0):
        from pympar.nn.wgrad import deferrable
        self._spin(self.t)                       # the input gradient (B)
        deferrable(lambda: self._spin(self.t))   # the weight gradients (W)
        return dy

    def named_parameters(self, prefix=""):
        return iter(())


class SleepBlock(SpinBlock):
    """Forward: sleep ``t`` seconds; backward: 2t (emulation that leaves the cores free)."""

    @staticmethod
    def _spin(t):
        time.sleep(t)


class FlopsBlock(SpinBlock):
    """Forward: ``reps`` 64x64 matmuls; backward: twice as many. Identity on the activations."""

    _a = None

    def __init__(self, reps):
        import numpy as np
        self.reps = reps
        if FlopsBlock._a is None:
            FlopsBlock._a = np.random.default_rng(0).standard_normal((64, 64)) / 8

    def _work(self, n):
        a = b = self._a
        for _ in range(n):
            b = a @ b
        return b

    def forward(self, x):
        self._work(self.reps)
        return x, None

    def backward(self, dy, ctx, daux=1.0):
        from pympar.nn.wgrad import deferrable
        self._work(self.reps)
        deferrable(lambda: self._work(self.reps))
        return dy


class BenchFactory:
    """Real embedding and head (pympar.nn), emulated or real blocks."""

    def __init__(self, args):
        import numpy as np
        from pympar.nn.gpt import GPTParts
        self.args, self.real = args, GPTParts(np.float32)
        self.dtype, self.compute_dtype = self.real.dtype, None

    def embedding(self, config, seed):
        return self.real.embedding(config, seed)

    def head(self, config, embedding, seed):
        return self.real.head(config, embedding, seed)

    def block(self, config, i, seed):
        if self.args.work == "spin":
            return SpinBlock(self.args.block_ms / 1e3)
        if self.args.work == "sleep":
            return SleepBlock(self.args.block_ms / 1e3)
        if self.args.work == "flops":
            return FlopsBlock(self.args.reps)
        return self.real.block(config, i, seed)


# --- one pipeline size, inside mpiexec ----------------------------------------------------------
def run_rank(args):
    import numpy as np
    from mpi4py import MPI

    from pympar.comm import MPIComm
    from pympar.config import apply_environment
    from pympar.parallel.cores import share_cores
    env = apply_environment()
    from pympar.nn import GPTConfig
    from pympar.parallel.pp import (PipelineExecutor, PipelineGPT, bubble_formula, build_schedule,
                                    simulate, validate_schedule)

    world = MPIComm(MPI.COMM_WORLD)
    p, r = world.size, world.rank
    share_cores(world, env.threads, env.threads_from)      # each rank its share of the node's cores
    C = args.embd if args.work == "model" else 16
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=args.layers, n_head=4, n_embd=C)
    rng = np.random.default_rng(0)
    lat = neighbour_latency(world, (2, 32, C), np.float32)
    rows = []
    from pympar.parallel.pp.schedules import SPLIT_BACKWARD, V_PLACED, measured_costs, placement_of
    runs = [(sched, c) for sched in args.schedules.split(",")
            for c in (args.costs.split(",") if sched in ("zb-h1", "zb-v") else ["unit"])]
    for sched, costs in runs:
        v = args.v if sched == "interleaved" else (2 if sched in V_PLACED else 1)
        for m in ints(args.m):
            try:
                validate_schedule(sched, p, m, v)
            except ValueError:
                continue
            model = PipelineGPT(cfg, seed=0, pp=p, rank=r, v=v, factory=BenchFactory(args),
                                placement=placement_of(sched))
            ex = PipelineExecutor(model, world, sched)
            mbs = [(rng.integers(0, 64, (2, 32)), rng.integers(0, 64, (2, 32))) for _ in range(m)]
            per_step = []
            for it in range(args.warmup + args.steps):
                model.zero_grad()
                world.barrier()
                st = ex.train_step(mbs)
                if costs == "measured" and ex.costs is None:    # the warm-up step's times: each stage's rank
                    ex.costs = measured_costs(np.asarray(world.allreduce(st["stage_times"].copy())))
                if it >= args.warmup:
                    per_step.append((st["bubble"], st["recv_wait_s"] / st["step_s"], st["step_s"],
                                     st["f_s"] / m, st["b_s"] / m, st["w_s"] / m))
            mine = np.median(np.array(per_step), axis=0)           # (bubble, wait fraction, step_s, F, B, W)
            allr = MPI.COMM_WORLD.gather(mine.tolist(), root=0)
            peaks = MPI.COMM_WORLD.gather(st["peak_in_flight"], root=0)
            if r == 0:
                a = np.array(allr)
                fbw = a[:, 3:6].mean(axis=0)                        # per micro-batch and stage, mean rank
                # zb-h1, dualpipev: the formula with the measured F, B, W; the others' formulas hold
                # whatever the times (B there is the whole backward)
                formula = bubble_formula(sched, p, m, v, *fbw) if sched in ("zb-h1", "dualpipev") else \
                    bubble_formula(sched, p, m, v)
                # the same schedule on the discrete-event model with the nominal block cost and
                # the measured one-way message latency: what a perfect executor would show here
                f = args.block_ms / 1e3 * args.layers / p if args.work in ("spin", "sleep") else 0.0
                sim = simulate([build_schedule(sched, p, m, v, q, ex.costs) for q in range(p)], p, v,
                               f_cost=f, b_cost=2 * f, comm_cost=lat, w_cost=f,
                               placement=placement_of(sched)) if f else None
                rows.append(dict(schedule=sched, p=p, m=m, v=v, work=args.work, costs=costs,
                                 table_costs=[list(c) for c in ex.costs] if ex.costs else None,
                                 formula=formula,
                                 measured_f_ms=float(fbw[0] * 1e3), measured_b_ms=float(fbw[1] * 1e3),
                                 measured_w_ms=float(fbw[2] * 1e3),
                                 latency_ms=lat * 1e3,
                                 model_with_latency=float(np.mean(sim["bubble"])) if sim else None,
                                 bubble_mean=float(a[:, 0].mean()), bubble_max=float(a[:, 0].max()),
                                 bubble_per_rank=[float(x) for x in a[:, 0]],
                                 recv_wait_fraction_mean=float(a[:, 1].mean()),
                                 step_ms=float(a[:, 2].max() * 1e3), peak_in_flight=peaks))
    if r == 0:
        print(json.dumps(rows), flush=True)


def neighbour_latency(world, shape, dtype, reps=30):
    """Median one-way time of an activation-sized message between pipeline neighbours (s)."""
    import numpy as np
    a, b = np.zeros(shape, dtype), np.empty(shape, dtype)
    r, p = world.rank, world.size
    times = []
    for _ in range(reps):
        world.barrier()
        t = time.perf_counter()
        if p > 1 and r % 2 == 0 and r + 1 < p:             # ping-pong on pairs (0,1), (2,3), ...
            world.isend(a, r + 1, tag=5).wait()
            world.irecv(b, r + 1, tag=6).wait()
        elif p > 1 and r % 2 == 1:
            world.irecv(b, r - 1, tag=5).wait()
            world.isend(a, r - 1, tag=6).wait()
        times.append((time.perf_counter() - t) / 2)
    mine = float(np.median(times)) if p > 1 else 0.0
    return float(world.allreduce(np.array([mine]), op="max")[0])


# --- driver ----------------------------------------------------------------------------------
def table(rows):
    head = (f"{'schedule':<12}{'p':>3}{'m':>4}{'v':>3}{'formula':>9}{'bubble':>9}{'worst':>8}{'diff':>8}"
            f"{'+latency':>9}{'step ms':>9}  {'F/B/W ms per micro-batch':<26}peak in flight")
    lines = [head, "-" * len(head)]
    for x in rows:
        fbw = f"{x['measured_f_ms']:.2f}/{x['measured_b_ms']:.2f}/{x['measured_w_ms']:.2f}"
        lines.append(f"{_label(x):<12}{x['p']:>3}{x['m']:>4}{x['v']:>3}{x['formula']:>9.3f}"
                     f"{x['bubble_mean']:>9.3f}{x['bubble_max']:>8.3f}{x['bubble_mean'] - x['formula']:>+8.3f}"
                     f"{x['model_with_latency'] if x['model_with_latency'] is not None else float('nan'):>9.3f}"
                     f"{x['step_ms']:>9.1f}  {fbw:<26}{x['peak_in_flight']}")
    by = {(x["schedule"], x["p"], x["m"]): x for x in rows if x["schedule"] == "1f1b"}
    for x in rows:
        one = by.get(("1f1b", x["p"], x["m"]))
        if x["schedule"] in ("zb-h1", "zb-v", "dualpipev") and one and one["bubble_mean"] > 0:
            lines.append(f"p={x['p']} m={x['m']}: {_label(x)} / 1f1b bubble {x['bubble_mean'] / one['bubble_mean']:.2f}, "
                         f"step time {x['step_ms'] / one['step_ms']:.2f}")
    zbv = {(x["p"], x["m"]): x for x in rows if x["schedule"] == "zb-v" and x.get("costs") != "measured"}
    for x in rows:
        z = zbv.get((x["p"], x["m"]))
        if x["schedule"] == "dualpipev" and z and z["bubble_mean"] > 0:
            lines.append(f"p={x['p']} m={x['m']}: dualpipev / zb-v bubble {x['bubble_mean'] / z['bubble_mean']:.2f}, "
                         f"step time {x['step_ms'] / z['step_ms']:.2f}, peak in flight {max(x['peak_in_flight'])} "
                         f"vs {max(z['peak_in_flight'])}")
    lat = sorted({round(x['latency_ms'], 3) for x in rows if x['p'] > 1})
    lines.append(f"measured one-way neighbour latency (ms): {lat}; +latency = the discrete-event model "
                 f"of the same schedule with that latency (0 latency = formula)")
    return "\n".join(lines)


def _label(row):
    """The schedule, with ' m' when its table was built for the measured times."""
    return row["schedule"] + (" m" if row.get("costs") == "measured" else "")


def launch(args, argv):
    sys.path.insert(0, str(ROOT / "tests"))
    from mpirun import mpi_env, mpiexec
    rows = []
    passthru = [a for a in argv if a != "--launch"]
    # drop --pp and --json (the driver's own)
    clean, skip = [], False
    for a in passthru:
        if skip:
            skip = False
            continue
        if a in ("--pp", "--json"):
            skip = True
            continue
        if a.startswith("--pp=") or a.startswith("--json="):
            continue
        clean.append(a)
    for p in ints(args.pp):
        cmd = [mpiexec(), "-n", str(p), sys.executable, str(Path(__file__).resolve()), *clean]
        out = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=900)
        if out.returncode:
            sys.exit(f"p={p} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print(table(rows))
    if args.json:
        meta = dict(cores=os.cpu_count(), load_average=os.getloadavg(), work=args.work, block_ms=args.block_ms, reps=args.reps, embd=args.embd,
                    layers=args.layers, steps=args.steps, costs=args.costs)
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.launch:
        launch(args, argv)
    else:
        run_rank(args)


if __name__ == "__main__":
    main()
