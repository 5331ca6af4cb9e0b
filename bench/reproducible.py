"""The cost of reproducible sums: allreduce(x, reproducible=True) against the default allreduce and
the MPI library's own, and the trainer's --deterministic against its default step.

    python bench/reproducible.py                       # 2 and 4 ranks, 4 KiB .. 16 MiB, and the trainer
    python bench/reproducible.py --quick               # a smoke run

Collectives: one ``mpiexec -n N python bench/reproducible.py --rank-job`` per rank count; float32
sum, out of place, the slowest rank's mean over the iterations after a warm-up, the calls (the
library's, auto, pympar's ring, reproducible) interleaved per size. busbw follows nccl-tests (2 (n-1)/n x size / time). The reproducible call
moves 3 int64 per float32 element (6x the bytes) plus the tops, and converts on both ends.
Trainer: ``python -m pympar.train --preset tiny`` at dp = 2 on the same global batch, median
tokens/s of the logged steps, with and without --deterministic (one sequence at a time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, env, machine, mpiexec, output_paths  # noqa: E402


def rank_job(sizes, iters):
    import numpy as np
    from mpi4py import MPI

    from pympar.comm import MPIComm

    world = MPI.COMM_WORLD
    comm = MPIComm(world, name="repro", timeout=120)
    rows = []
    for nbytes in sizes:
        x = np.random.default_rng(world.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        calls = {"library": lambda: world.Allreduce(x, out, op=MPI.SUM),
                 "auto": lambda: comm.allreduce(x, out=out),
                 "ring": lambda: comm.allreduce(x, out=out, algo="ring"),
                 "reproducible": lambda: comm.allreduce(x, out=out, reproducible=True)}
        times = {k: [] for k in calls}
        for k, f in calls.items():                          # warm-up (auto measures its choice here)
            for _ in range(3):
                f()
        for _ in range(iters):
            for k, f in calls.items():
                world.Barrier()
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        mean = {k: world.allreduce(statistics.fmean(v), op=MPI.MAX) for k, v in times.items()}
        n = world.size
        rows.append(dict(ranks=n, bytes=nbytes, **{f"{k}_us": 1e6 * v for k, v in mean.items()},
                         reproducible_busbw_gbs=2 * (n - 1) / n * nbytes / mean["reproducible"] / 1e9,
                         auto_busbw_gbs=2 * (n - 1) / n * nbytes / mean["auto"] / 1e9,
                         ring_busbw_gbs=2 * (n - 1) / n * nbytes / mean["ring"] / 1e9,
                         reproducible_over_auto=mean["reproducible"] / mean["auto"]))
    if world.rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)


def trainer(det: bool, steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        args = [mpiexec(), "-n", "2", sys.executable, "-m", "pympar.train", "--preset", "tiny", "--block-size", "64",
                "--micro-batch-size", "4", "--n-micro", "4", "--steps", str(steps), "--eval-every", "0",
                "--sample-tokens", "0", "--dtype", "float32", "--threads", "1", "--out", d]
        subprocess.run(args + (["--deterministic"] if det else []), check=True, env=env(), cwd=ROOT,
                       capture_output=True, timeout=600)
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        return statistics.median(r["tokens_per_s"] for r in rows[1:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="default bench/results/reproducible.json (--quick: under bench/results/quick/)")
    a = ap.parse_args(argv)
    a.json = a.json or str(output_paths("reproducible", a.quick)[0])
    sizes = [int(s) for s in a.sizes.split(",") if s] or ([4096, 1 << 20] if a.quick else
                                                           [4096, 65536, 1 << 20, 16 << 20])
    if a.rank_job:
        rank_job(sizes, a.iters)
        return 0
    rows = []
    for n in ([2] if a.quick else [2, 4]):
        p = subprocess.run([mpiexec(), "-n", str(n), sys.executable, __file__, "--rank-job", "--sizes",
                            ",".join(map(str, sizes)), "--iters", str(3 if a.quick else a.iters)],
                           capture_output=True, text=True, env=env(), cwd=ROOT, timeout=1800, check=True)
        rows += json.loads(next(x for x in p.stdout.splitlines() if x.startswith("ROWS "))[5:])
    steps = 4 if a.quick else 12
    plain, det = [], []
    for _ in range(1 if a.quick else 3):                     # alternating rounds
        plain.append(trainer(False, steps))
        det.append(trainer(True, steps))
    res = dict(machine=machine(), collectives=rows,
               trainer=dict(preset="tiny", dp=2, micro_batch_size=4, n_micro=4, block_size=64,
                            default_tokens_per_s=statistics.median(plain),
                            deterministic_tokens_per_s=statistics.median(det),
                            deterministic_over_default=statistics.median(det) / statistics.median(plain)))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    for r in rows:
        print(f"{r['ranks']} ranks {r['bytes']:>9} B: library {r['library_us']:9.1f} us, auto {r['auto_us']:9.1f} us, "
              f"reproducible {r['reproducible_us']:9.1f} us ({r['reproducible_over_auto']:.1f}x auto)")
    t = res["trainer"]
    print(f"trainer dp=2: {t['default_tokens_per_s']:.0f} tokens/s, --deterministic {t['deterministic_tokens_per_s']:.0f} "
          f"({t['deterministic_over_default']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
