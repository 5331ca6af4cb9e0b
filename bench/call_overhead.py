"""Per-call cost of pympar's communicator against the MPI library called directly through mpi4py.

A program that wraps its communicator, ``MPIComm(MPI.COMM_WORLD)``, and calls
``comm.allreduce(x, out=y)`` (algo auto) against the same program calling
``comm.Allreduce(x, y)`` on a duplicate of COMM_WORLD: float32, 8 B, 4 KiB and 64 KiB, out of place,
in one job per (transport, ranks). Rows: ``library`` (mpi4py's blocking ``Allreduce``), ``abort``
(``MPIComm(world)``: the default, on_timeout="abort"), ``raise`` (``MPIComm(world,
on_timeout="raise")``: every call polled). Time per call: the slowest rank's mean over a round of
back-to-back calls; rounds alternate between the rows; the best round per row counts (the VM's
descheduled moments only ever add time). ratio = row / library (< 1: faster than calling the
library directly). Ranks beyond 2 oversubscribe this machine's 2 cores.

    python bench/call_overhead.py                      # 2, 3, 4, 8 ranks; shm and network
    python bench/call_overhead.py --ranks 2 --transports shm --rounds 5
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TRANSPORTS = {"shm": {}, "network": {"MPIR_CVAR_NOLOCAL": "1"}}
SIZES = (8, 4096, 65536)
TARGET = 1.15


def rank_job(rounds: int, calls: int):
    import time

    import numpy as np
    from mpi4py import MPI

    from pympar.comm import MPIComm

    world = MPI.COMM_WORLD
    lib = world.Dup()
    comms = {"abort": MPIComm(world, name="abort"), "raise": MPIComm(world, name="raise", on_timeout="raise")}
    rows = []
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        run = {"library": lambda: lib.Allreduce(x, y)}
        for name, c in comms.items():
            run[name] = (lambda c=c: c.allreduce(x, out=y))
        for f in run.values():       # warm-up: auto decides its bucket, the plans are made
            for _ in range(max(calls // 10, 20)):
                f()
        best = dict.fromkeys(run, float("inf"))
        for _ in range(rounds):
            for name, f in run.items():
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                dt = world.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX)
                best[name] = min(best[name], dt)
        chosen = {name: c.explain("allreduce", nbytes).algo for name, c in comms.items()}
        rows.append(dict(bytes=nbytes, us={k: v * 1e6 for k, v in best.items()}, chosen=chosen))
    if world.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    for c in comms.values():
        c.free()


def one(n, transport, rounds, calls, timeout):
    cmd = [common.mpiexec(), "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--rank-job",
           "--rounds", str(rounds), "--calls", str(calls)]
    env = dict(common.env(), **TRANSPORTS[transport])
    env.pop("PYMPAR_TUNING", None)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=common.ROOT)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"{' '.join(cmd)} ({transport}) failed ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    return json.loads(line[len("RESULT "):])


def run(a):
    out = []
    for transport in a.transports.split(","):
        for n in [int(v) for v in a.ranks.split(",")]:
            for r in one(n, transport, a.rounds, a.calls, a.timeout):
                lib = r["us"]["library"]
                r.update(transport=transport, nranks=n,
                         ratio={k: v / lib for k, v in r["us"].items() if k != "library"})
                out.append(r)
                print(f"  {transport} n={n} {r['bytes']:>6} B: library {lib:8.2f} us  " +
                      "  ".join(f"{k} {r['us'][k]:8.2f} ({v:.2f}x, {r['chosen'][k]})" for k, v in r["ratio"].items()),
                      file=sys.stderr, flush=True)
    return dict(kind="call_overhead", machine=common.machine(), target=TARGET, rows=out)


def plot(res, png):
    plt = common.pyplot()
    rows = res["rows"]
    groups = [(t, n) for t in TRANSPORTS for n in sorted({r["nranks"] for r in rows if r["transport"] == t})]
    fig, axes = plt.subplots(1, len(SIZES), figsize=(4 * len(SIZES), 3.6), squeeze=False, sharey=True)
    for j, nbytes in enumerate(SIZES):
        ax = axes[0][j]
        labels = [f"{t}\n{n}r" for t, n in groups]
        for k, (mode, color) in enumerate((("abort", "tab:blue"), ("raise", "tab:orange"))):
            vals = [next((r["ratio"][mode] for r in rows if (r["transport"], r["nranks"], r["bytes"]) == (t, n, nbytes)),
                         float("nan")) for t, n in groups]
            ax.bar([i + 0.38 * (k - 0.5) for i in range(len(groups))], vals, width=0.38, color=color,
                   label=f"MPIComm(world{', on_timeout=raise' if mode == 'raise' else ''})")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(TARGET, color="tab:red", lw=0.8, ls="--")
        ax.set(xticks=range(len(groups)), title=f"allreduce {nbytes} B", ylabel="time / mpi4py Allreduce")
        ax.set_xticklabels(labels, fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"per-call time against the library called directly (dashed: {TARGET}x)\n({res['machine']})",
                 fontsize=8)
    common.save(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="shm,network")
    ap.add_argument("--ranks", default="2,3,4,8")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    args = sys.argv[1:] if argv is None else argv
    if "--rank-job" in args:
        a = ap.parse_args(args)
        return rank_job(a.rounds, a.calls)
    common.run_and_write(ap, args, "call_overhead", run, plot)


if __name__ == "__main__":
    main()
