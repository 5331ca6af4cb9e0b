"""The planner against measurement: predicted step time and memory per rank of
``pympar.plan`` against the real runner, for at least 8 layouts at 4 and at 8 ranks.

Per layout, one ``mpiexec -n world python bench/plan_accuracy.py --worker ...`` builds the
trainer's ParallelRunner (pympar.parallel.runner, the same code ``pympar.train`` runs) and
measures on every rank:
  params_bytes, grads_bytes   the rank's own parameters and gradients (exact counts)
  persistent_bytes            everything that stays allocated after step 2 (parameters,
                              gradients and their buckets, AdamW m, v or the ZeRO-1 shard):
                              tracemalloc after step 2 minus before the build; compared with
                              the planner's params + grads + optimizer
  activation_bytes            the peak of a step above what stays allocated: tracemalloc's
                              peak during step 3 minus its current memory before it
  step_s                      median of --steps timed steps (tracemalloc off), rank 0
The worst rank (largest predicted total, as the planner reports) is compared. Rank
correlation: Spearman's rho of predicted against measured step time over the layouts of
one world size, and pooled.

    python bench/plan_accuracy.py --world 4,8 --json bench/results/plan_accuracy.json --png docs/img/plan_accuracy.png
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from pympar.layout import Layout  # noqa: E402
from pympar.plan.cli import spearman  # noqa: E402

LAYOUTS = {   # preset small, global batch 16 (4 ranks) and 32 (8 ranks) sequences per step
    4: [Layout(dp=4, pp=1, tp=1, micro_batch_size=4, n_micro=1, schedule="1f1b"),
        Layout(dp=4, pp=1, tp=1, micro_batch_size=2, n_micro=2, schedule="1f1b", zero=1),
        Layout(dp=2, pp=2, tp=1, micro_batch_size=2, n_micro=4, schedule="1f1b"),
        Layout(dp=2, pp=2, tp=1, micro_batch_size=4, n_micro=2, schedule="gpipe"),
        Layout(dp=1, pp=4, tp=1, micro_batch_size=1, n_micro=16, schedule="1f1b"),
        Layout(dp=1, pp=4, tp=1, micro_batch_size=4, n_micro=4, schedule="gpipe"),
        Layout(dp=2, pp=2, tp=1, micro_batch_size=2, n_micro=4, schedule="interleaved", virtual_stages=2),
        Layout(dp=1, pp=1, tp=4, micro_batch_size=16, n_micro=1, schedule="1f1b"),
        Layout(dp=2, pp=1, tp=2, micro_batch_size=8, n_micro=1, schedule="1f1b", seq_parallel=True),
        Layout(dp=1, pp=2, tp=2, micro_batch_size=4, n_micro=4, schedule="1f1b")],
    8: [Layout(dp=8, pp=1, tp=1, micro_batch_size=4, n_micro=1, schedule="1f1b"),
        Layout(dp=8, pp=1, tp=1, micro_batch_size=2, n_micro=2, schedule="1f1b", zero=1),
        Layout(dp=4, pp=2, tp=1, micro_batch_size=2, n_micro=4, schedule="1f1b"),
        Layout(dp=2, pp=4, tp=1, micro_batch_size=1, n_micro=16, schedule="1f1b"),
        Layout(dp=2, pp=4, tp=1, micro_batch_size=2, n_micro=8, schedule="gpipe"),
        Layout(dp=4, pp=1, tp=2, micro_batch_size=8, n_micro=1, schedule="1f1b"),
        Layout(dp=2, pp=1, tp=4, micro_batch_size=16, n_micro=1, schedule="1f1b"),
        Layout(dp=2, pp=2, tp=2, micro_batch_size=4, n_micro=4, schedule="1f1b"),
        Layout(dp=1, pp=4, tp=2, micro_batch_size=4, n_micro=8, schedule="1f1b"),
        Layout(dp=1, pp=2, tp=4, micro_batch_size=8, n_micro=4, schedule="1f1b")],
}


# --- worker: inside mpiexec ------------------------------------------------------------------
def worker(train_argv: list, steps: int, alone: bool = False) -> None:
    """One rank of a layout; ``alone``: every rank runs its own one-process copy of the layout
    (no communication but a barrier before the timed steps), all at once on the node's cores."""
    import tracemalloc

    from mpi4py import MPI

    from pympar.comm import MPIComm
    from pympar.config import parse_args
    from pympar.data import load_corpus, local_micro_batches
    from pympar.parallel.cores import share_cores
    from pympar.parallel.mesh import Mesh
    from pympar.parallel.runner import build_runner

    mpi = MPI.COMM_WORLD
    c = parse_args(train_argv, 1 if alone else mpi.Get_size())
    cfg, run, lay = c.model, c.run, c.parallel
    share_cores(mpi, run.threads, run.threads_from, run.bind)   # as pympar.train: the node's cores shared
    corpus = load_corpus(run.data)
    comm = MPIComm(MPI.COMM_SELF if alone else mpi, name="world")
    dp_rank = Mesh.coords(mpi.Get_rank(), lay.dp, lay.pp, lay.tp)[1]

    def batches(s):
        return local_micro_batches(corpus.train, run.seed, s, dp_rank, lay.n_micro, lay.micro_batch_size, cfg.block_size)

    # modules imported lazily on first use are the process's baseline, not the run's buffers: load them
    # before tracing (numpy.ma: np.median's NaN check, from auto's first measurement, 0.5 MB of code;
    # ml_dtypes: the first bf16 array, 0.75 MB), else they count as memory the ledger left out
    import importlib

    from pympar import backend
    importlib.import_module("numpy.ma")
    backend.bfloat16                                     # imports ml_dtypes
    tracemalloc.start()
    b0 = batches(0)
    base = tracemalloc.get_traced_memory()[0]
    runner = build_runner(cfg, lay, comm, run, c.optim)
    built = tracemalloc.get_traced_memory()[0]
    for s in range(2):                                    # AdamW state and buffers appear here
        runner.train_step(batches(s) if s else b0, 1e-4)
    after2 = tracemalloc.get_traced_memory()[0]
    b3 = batches(2)
    tracemalloc.reset_peak()
    before3 = tracemalloc.get_traced_memory()[0]
    runner.train_step(b3, 1e-4)
    peak3 = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    times = []
    mpi.Barrier()
    for s in range(3, 3 + steps):
        b = batches(s)
        comm.barrier()
        t0 = time.perf_counter()
        runner.train_step(b, 1e-4)
        times.append(time.perf_counter() - t0)
    mine = dict(rank=mpi.Get_rank(), coords=Mesh.coords(0 if alone else mpi.Get_rank(), lay.dp, lay.pp, lay.tp),
                params=int(sum(p.data.size for p in runner.params)),
                params_bytes=int(sum(p.data.nbytes for p in runner.params)),
                grads_bytes=int(sum(p.grad.nbytes for p in runner.params if p.grad is not None)),
                build_bytes=built - base, persistent_bytes=after2 - base, activation_bytes=peak3 - before3,
                step_s=statistics.median(times))
    got = mpi.gather(mine, root=0)
    if mpi.Get_rank() == 0:
        print("RESULT " + json.dumps(got), flush=True)


# --- launcher ----------------------------------------------------------------------------------
def measure(world: int, lay: Layout, preset: str, steps: int, timeout: float, alone: bool = False) -> list:
    """Each rank's figures (worker) of ``lay`` on ``world`` ranks; ``alone``: ``world`` one-process
    copies of ``lay`` at once."""
    argv = ["--preset", preset, *lay.train_args(), "--steps", "10"]
    p = common.launch(world, [__file__, "--worker", "--steps", str(steps), *(["--alone"] if alone else []), "--", *argv],
                      timeout)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"{lay.key()} failed ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    return json.loads(lines[-1][7:])


def machine_for(world: int, bench_json, calibration=None):
    from pympar.plan.cli import build_machine

    ns = argparse.Namespace(device="cpu", peak_flops=None, mem_per_rank=None, ranks_per_node=world,
                            bench_json=bench_json, overlap=None, world=world, calibration=calibration)
    return build_machine(ns)


def run(a) -> dict:
    from pympar.nn import GPTConfig
    from pympar.plan.cost import params_per_rank, predict

    cfg = GPTConfig.from_preset(a.preset)
    rows, machines, cals = [], {}, {}
    for world in [int(x) for x in a.world.split(",")]:
        cal = None
        if a.calibrate:
            import plan_calibrate
            cal = plan_calibrate.Calibration(a.preset, [world], plan_calibrate.parse_shapes(a.calibrate_shapes), 5, a.timeout)
        meas = {lay.key(): [] for lay in LAYOUTS[world]}
        for k in range(a.rounds):                          # rounds interleaved: the load drifts
            if cal:                                        # the constants of the same minutes, not of these layouts
                cal.round()
            for lay in LAYOUTS[world]:
                try:
                    meas[lay.key()].append(measure(world, lay, a.preset, a.steps, a.timeout))
                except RuntimeError as e:
                    print(f"  w{world} {lay.key()}: {str(e)[:300]}", file=sys.stderr, flush=True)
        if cal:
            cals[str(world)] = cal.result()
        m = machines[str(world)] = machine_for(world, a.bench_json, cals.get(str(world), a.calibration))
        for lay in LAYOUTS[world]:
            runs = meas[lay.key()]
            if not runs:
                rows.append(dict(world=world, layout=lay.key(), status="failed"))
                continue
            p = predict(cfg, lay, m)
            ranks = runs[0]
            step = statistics.median(r[0]["step_s"] for r in runs)
            from pympar.parallel.pp.partition import partition
            part = partition(cfg, lay.pp, lay.virtual_stages)
            pred_params = []
            for r in ranks:
                st = part.stages_of(r["coords"][0])
                blocks = [i for s in st for i in part.blocks(s)]
                pred_params.append(params_per_rank(cfg, lay, blocks, 0 in st, part.n_stage - 1 in st))
            worst = max(ranks, key=lambda r: r["persistent_bytes"] + r["activation_bytes"])
            row = dict(world=world, layout=lay.key(), status="ok", predicted_s=p.step_time, measured_s=step,
                       measured_rounds=[r[0]["step_s"] for r in runs], predicted_time=p.time,
                       predicted_memory=p.memory, peak_in_flight=p.peak_in_flight,
                       params_exact=all(pp_ == r["params"] for pp_, r in zip(pred_params, ranks)),
                       params_predicted=pred_params, params_measured=[r["params"] for r in ranks],
                       measured_memory=dict(params=worst["params_bytes"], grads=worst["grads_bytes"],
                                            persistent=max(r["persistent_bytes"] for r in ranks),
                                            activations=max(r["activation_bytes"] for r in ranks)))
            pm = p.memory
            row["activation_ratio"] = row["measured_memory"]["activations"] / pm["activations"] if pm["activations"] else None
            row["persistent_ratio"] = row["measured_memory"]["persistent"] / (pm["parameters"] + pm["gradients"] + pm["optimizer"])
            rows.append(row)
            print(f"  w{world} {lay.key():<44} pred {p.step_time * 1e3:7.1f} ms  meas {step * 1e3:7.1f} ms  "
                  f"params {'exact' if row['params_exact'] else 'DIFFER'}  act meas/pred {row['activation_ratio']:.2f}  "
                  f"persistent meas/pred {row['persistent_ratio']:.2f}", file=sys.stderr, flush=True)
    res = dict(kind="plan_accuracy", machine=common.machine(), preset=a.preset, rounds=a.rounds, rows=rows,
               spearman={}, calibration=cals or a.calibration, bench_json=a.bench_json,
               constants={w: vars(m) for w, m in machines.items()})
    for world in sorted({r["world"] for r in rows}):
        ok = [r for r in rows if r["world"] == world and r["status"] == "ok"]
        if len(ok) >= 3:
            res["spearman"][str(world)] = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])
    ok = [r for r in rows if r["status"] == "ok"]
    if len(ok) >= 3:
        res["spearman"]["pooled"] = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])
    print(f"Spearman rho predicted vs measured step time: {res['spearman']}", flush=True)
    return res


def plot(res: dict, png) -> None:
    plt = common.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for world, mk in ((4, "o"), (8, "s")):
        ok = [r for r in res["rows"] if r["world"] == world and r["status"] == "ok"]
        if not ok:
            continue
        rho = res["spearman"].get(str(world), float("nan"))
        ax.scatter([r["predicted_s"] * 1e3 for r in ok], [r["measured_s"] * 1e3 for r in ok], marker=mk,
                   label=f"{world} ranks: Spearman {rho:.2f}")
        ax2.scatter([r["predicted_memory"]["activations"] / 2**20 for r in ok],
                    [r["measured_memory"]["activations"] / 2**20 for r in ok], marker=mk, label=f"{world} ranks")
    lim = ax.get_xlim()[1], ax.get_ylim()[1]
    ax.plot([0, max(lim)], [0, max(lim)], "k:", lw=0.6)
    ax.set(xlabel="predicted step (ms)", ylabel="measured step (ms)",
           title=f"step time, {len(res['rows'])} layouts (pooled rho {res['spearman'].get('pooled', float('nan')):.2f})")
    lim2 = max(ax2.get_xlim()[1], ax2.get_ylim()[1])
    ax2.plot([0, lim2], [0, lim2], "k:", lw=0.6)
    ax2.set(xlabel="predicted activation MiB (worst rank)", ylabel="measured peak above steady (MiB)",
            title="activation memory per rank, measured vs predicted")
    ax.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle(f"planner vs measurement, preset {res['preset']} ({common.machine()})", fontsize=8)
    common.save(fig, png)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        i = argv.index("--")
        steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv[:i] else 4
        return worker(argv[i + 1:], steps, alone="--alone" in argv[:i])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="4,8")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per layout")
    ap.add_argument("--rounds", type=int, default=2, help="runs per layout, interleaved; median kept")
    ap.add_argument("--bench-json", nargs="*", default=None, help="pympar.bench --json files for the planner's alpha/beta")
    ap.add_argument("--calibration", default=None,
                    help="bench/plan_calibrate.py JSON for the planner's CPU constants (measured apart from these layouts)")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure bench/plan_calibrate.py's microbenchmarks (single process, allreduce at the rank "
                         "count) before each round of layouts and predict with those constants")
    ap.add_argument("--calibrate-shapes", default="1x1,4x1,16x1,1x4,4x4", help="BxM shapes of the single-process steps")
    ap.add_argument("--timeout", type=float, default=600)
    common.run_and_write(ap, argv, "plan_accuracy", run, plot)


if __name__ == "__main__":
    main()
