"""Tensor parallelism's communication share: ``tp_comm_fraction`` and step time for tp = 1, 2, 4,
with and without sequence parallelism, on one small model (TPGPT driven directly, one rank per
tp rank, AdamW step included).

    python bench/tp_comm.py --json bench/results/tp_comm.json
    python bench/tp_comm.py --tp 1,2 --steps 3 --preset tiny        # quick look

tp_comm_fraction = seconds inside TP collectives (TPCollectives' timer: starting and waiting
for each collective; a backward allreduce hidden behind the weight-gradient GEMM costs only its
wait) / step seconds, the max over ranks of the median step. Activation bytes per rank (the
arrays one micro-batch's forward keeps) show what sequence parallelism saves. On this 2-core
machine tp = 4 oversubscribes the cores: waiting for a descheduled peer counts as communication,
so the fraction at tp 4 is an upper bound; ratios within one run are the figures to read.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TAG = "TP_COMM_ROW "


def worker(a) -> None:
    """One tp group of comm.size ranks: warm-up, then timed steps; rank 0 prints a JSON row."""
    import numpy as np
    from mpi4py import MPI

    from pympar.comm import MPIComm
    from pympar.config import apply_environment
    from pympar.parallel.cores import share_cores
    env = apply_environment()
    from pympar.nn import GPTConfig
    from pympar.parallel.gradsync import GradSync
    from pympar.parallel.mesh import Mesh
    from pympar.parallel.meter import Meter
    from pympar.parallel.tp import TPGPT, TPCollectives, activation_bytes

    comm = MPIComm(MPI.COMM_WORLD, name="tp")
    share_cores(comm, env.threads, env.threads_from)     # each rank its share of the node's cores
    cfg = GPTConfig.from_preset(a.preset)
    meter = Meter()                                  # the TP collectives' seconds and calls
    model = TPGPT(cfg, TPCollectives(comm, meter=meter), seed=0, sequence_parallel=a.sp, compute_dtype=a.compute_dtype)
    sync = GradSync(model.named_parameters(), Mesh(comm, tp=comm.size))     # the trainer's path
    opt = sync.make_optimizer(lr=1e-3)
    rng = np.random.default_rng(0)
    T = cfg.block_size

    def batch():
        toks = rng.integers(0, cfg.vocab_size, size=(a.batch, T + 1))
        return toks[:, :-1], toks[:, 1:]

    steps, comm_s, calls = [], [], 0
    for s in range(a.warmup + a.steps):
        x, y = batch()
        comm.barrier()
        meter.take()
        t0 = time.perf_counter()
        model.zero_grad()
        sync.begin_step()
        sync.begin_micro(last=True)
        model.loss_and_grad(x, y)
        sync.finish()
        sync.step(opt, 1e-3, 1.0, float(np.asarray(comm.allreduce(np.array([sync.local_sq()]))).reshape(-1)[0]))
        dt = time.perf_counter() - t0
        tp = meter.take().get("tp")
        c, calls = (tp.seconds, tp.calls) if tp is not None else (0.0, 0)
        if s >= a.warmup:
            steps.append(dt)
            comm_s.append(c)
    step = float(np.median(steps))
    frac = float(np.median([c / t for c, t in zip(comm_s, steps)]))
    # the slowest rank's step and its fraction are what a trainer would see
    rows = MPI.COMM_WORLD.gather(dict(step=step, frac=frac, calls=calls), root=0)
    act = activation_bytes(model, *batch())
    if comm.rank == 0:
        slow = max(rows, key=lambda r: r["step"])
        print(TAG + json.dumps(dict(
            tp=comm.size, sp=bool(a.sp), preset=a.preset, batch=a.batch, seq_len=T,
            compute_dtype=a.compute_dtype or "float32", steps=a.steps,
            step_ms=slow["step"] * 1e3, tp_comm_fraction=slow["frac"],
            tp_comm_fraction_mean=sum(r["frac"] for r in rows) / len(rows),
            tokens_per_s=a.batch * T / slow["step"], activation_bytes_per_rank=int(act))), flush=True)


def run(a) -> list:
    rows = []
    for tp in [int(t) for t in a.tp.split(",")]:
        for sp in (False, True):
            if sp and tp == 1:
                continue                          # sequence parallelism needs tp > 1
            args = [__file__, "--worker", "--preset", a.preset, "--batch", a.batch, "--steps", a.steps,
                    "--warmup", a.warmup] + (["--sp"] if sp else []) + (
                    ["--compute-dtype", a.compute_dtype] if a.compute_dtype else [])
            p = common.launch(tp, args, timeout=a.timeout)
            got = [json.loads(l[len(TAG):]) for l in p.stdout.splitlines() if l.startswith(TAG)]
            if p.returncode != 0 or not got:
                raise RuntimeError(f"tp={tp} sp={sp} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
            rows.append(got[0])
            print(f"  tp={tp} sp={sp}: {got[0]['step_ms']:.1f} ms/step, "
                  f"tp_comm_fraction {got[0]['tp_comm_fraction']:.3f}", file=sys.stderr, flush=True)
    base = next((r["step_ms"] for r in rows if r["tp"] == 1), None)
    for r in rows:
        r["step_vs_tp1"] = r["step_ms"] / base if base else None
    return rows


def table(rows) -> str:
    head = ("| tp | SP | step (ms) | vs tp 1 | tp_comm_fraction (slowest rank) | mean over ranks "
            "| tokens/s | activation MiB/rank |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        vs = f"{r['step_vs_tp1']:.2f}x" if r.get("step_vs_tp1") else "-"
        lines.append(f"| {r['tp']} | {'yes' if r['sp'] else 'no'} | {r['step_ms']:.1f} | {vs} | "
                     f"{r['tp_comm_fraction']:.3f} | {r['tp_comm_fraction_mean']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['activation_bytes_per_rank'] / 2**20:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="1,2,4", help="comma-separated tp sizes (default 1,2,4)")
    ap.add_argument("--preset", default="small", help="model preset (default small: 4 layers, C=128, T=128)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--compute-dtype", default=None, choices=[None, "bfloat16", "float16"],
                    help="mixed precision (default: float32)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sp", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    rows = run(a)
    print(f"TP communication share, preset {a.preset}, batch {a.batch}; {common.machine()}")
    print(table(rows))
    if a.json:
        common.write_json(a.json, dict(machine=common.machine(), rows=rows))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
