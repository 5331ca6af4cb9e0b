"""The seed's parameter-server comparison: one step's gradient synchronisation through server ranks
against pympar's allreduce among the same workers.

    python bench/param_server.py            # W = 2, 4, 6 workers with S = 1 and 2 servers, shm and network
    python bench/param_server.py --quick    # a smoke run

Parameter server (the baseline): ranks 0..S-1 are servers, the other W ranks workers. Each worker
pushes shard s of its gradient (float32, sharded evenly over the servers) to server s; each server
receives the W shards (posted receives, summed as they arrive), averages them, applies the update
(SGD on its shard of the parameters, one multiply-add) and sends the updated shard back to every
worker, which receives all shards of its parameters. Allreduce (pympar): the W workers alone
(a communicator of W ranks) average their gradients with ``MPIComm.allreduce`` (auto) and apply the
same update locally. Both move a step's whole gradient; one synchronisation is timed per iteration
(barrier, then the slowest rank's time), the two interleaved, the median over iterations after a
warm-up (the VM's descheduled moments made single iterations 10x slower; the mean followed them). Transports: MPICH's default (shared memory) and ``MPIR_CVAR_NOLOCAL=1`` (every message
through the network module, as between nodes). Ranks beyond 2 oversubscribe the 2 cores.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, env, machine, mpiexec, output_paths  # noqa: E402

LR = 1e-3


def rank_job(servers: int, nbytes: int, iters: int):
    import numpy as np
    from mpi4py import MPI

    from pympar.comm import MPIComm

    world = MPI.COMM_WORLD
    r, p = world.rank, world.size
    W = p - servers
    n = nbytes // 4
    bounds = [n * s // servers for s in range(servers + 1)]
    is_server = r < servers
    workers = world.Split(0 if not is_server else MPI.UNDEFINED, r)
    wcomm = MPIComm(workers, name="workers", timeout=120) if not is_server else None
    rng = np.random.default_rng(r)
    if is_server:
        lo, hi = bounds[r], bounds[r + 1]
        params = np.zeros(hi - lo, np.float32)
        bufs = [np.empty(hi - lo, np.float32) for _ in range(W)]
    else:
        grad = rng.standard_normal(n).astype(np.float32)
        params = np.zeros(n, np.float32)

    def ps_step():
        if is_server:
            reqs = [world.Irecv(bufs[w], source=servers + w, tag=1) for w in range(W)]
            acc = None
            for _ in range(W):
                i = MPI.Request.Waitany(reqs)
                acc = bufs[i].copy() if acc is None else np.add(acc, bufs[i], out=acc)
            acc *= np.float32(1.0 / W)
            params[...] -= np.float32(LR) * acc
            MPI.Request.Waitall([world.Isend(params, dest=servers + w, tag=2) for w in range(W)])
        else:
            sends = [world.Isend(grad[bounds[s]:bounds[s + 1]], dest=s, tag=1) for s in range(servers)]
            recvs = [world.Irecv(params[bounds[s]:bounds[s + 1]], source=s, tag=2) for s in range(servers)]
            MPI.Request.Waitall(sends + recvs)

    def ar_step():
        if not is_server:
            g = wcomm.allreduce(grad, inplace=False)
            g *= np.float32(1.0 / W)
            params[...] -= np.float32(LR) * g

    # the two compute the same update (checked once from zero parameters; float sums in other orders)
    ps_step()
    got = None if is_server else params.copy()
    params[...] = 0
    ar_step()
    ok = True if is_server else bool(np.allclose(got, params, rtol=1e-5, atol=1e-9))
    same = all(world.allgather(ok))
    times = {"ps": [], "allreduce": []}
    for k in range(iters + 3):
        for name, f in (("ps", ps_step), ("allreduce", ar_step)):
            world.Barrier()
            t0 = time.perf_counter()
            f()
            dt = time.perf_counter() - t0
            dt = world.allreduce(dt, op=MPI.MAX)
            if k >= 3:
                times[name].append(dt)
    if r == 0:
        ps, ar = statistics.median(times["ps"]), statistics.median(times["allreduce"])
        print("ROW " + json.dumps(dict(workers=W, servers=servers, bytes=nbytes, ps_ms=1e3 * ps, allreduce_ms=1e3 * ar,
                                       ps_over_allreduce=ps / ar, same_update=same)), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank-job", nargs=3, type=int, metavar=("SERVERS", "BYTES", "ITERS"), help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="default bench/results/param_server.json (--quick: under bench/results/quick/)")
    a = ap.parse_args(argv)
    a.json = a.json or str(output_paths("param_server", a.quick)[0])
    if a.rank_job:
        rank_job(*a.rank_job)
        return 0
    layouts = [(2, 1)] if a.quick else [(2, 1), (4, 1), (4, 2), (6, 2)]           # (workers, servers)
    sizes = [1 << 20] if a.quick else [1 << 20, 16 << 20]                       # tiny-model and 4M-parameter grads
    transports = {"shm": {}} if a.quick else {"shm": {}, "network": {"MPIR_CVAR_NOLOCAL": "1"}}
    rows = []
    for tr, extra in transports.items():
        for W, S in layouts:
            for nbytes in sizes:
                iters = 3 if a.quick else (20 if nbytes <= 1 << 20 else 8)
                p = subprocess.run([mpiexec(), "-n", str(W + S), sys.executable, __file__, "--rank-job", str(S),
                                    str(nbytes), str(iters)], capture_output=True, text=True, env={**env(), **extra},
                                   cwd=ROOT, timeout=900, check=True)
                row = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("ROW "))[4:])
                row["transport"] = tr
                rows.append(row)
                print(f"{tr:8} W={W} S={S} {nbytes >> 20:>3} MiB: parameter server {row['ps_ms']:8.2f} ms, "
                      f"allreduce {row['allreduce_ms']:8.2f} ms, PS / allreduce {row['ps_over_allreduce']:.2f}",
                      flush=True)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(dict(machine=machine(), rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
