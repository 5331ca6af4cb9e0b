"""Context parallelism's attention traffic and time: the ring against Ulysses' all-to-alls.

    python bench/cp_comm.py                 # cp 2 and 4, T 2048-8192 (a few minutes on 2 cores)
    python bench/cp_comm.py --quick         # cp 2, T 512 (the smoke test)

Each row is one ``mpiexec -n cp`` launch of this file's worker: the attention core alone (the
runner's RingAttentionCore or UlyssesAttentionCore on a cp communicator), batch 1, 8 heads of 64,
float32, forward and backward of this rank's 2c = T/cp positions, the two cores alternating. Bytes:
every array this rank hands the communicator to send to another rank, counted by a wrapper around
its isend and alltoall (an all-to-all's own block stays home), against the closed forms, in units
of u = B x 2c x C x itemsize (this rank's share of one activation):

    ring   forward: the key/value block, cp - 1 hops (2u each); backward: the blocks again and the
           dK/dV accumulator, cp hops            -> (cp - 1 + cp - 1 + cp) x 2u = (6 cp - 4) u
    a2a    forward: q, k, v out and the output back, (cp - 1)/cp of each (4u); backward: the same
           4u the other way                      -> 8 (cp - 1)/cp u

At a fixed T per rank the ring's traffic grows with cp and Ulysses' does not. Time: the median
over rounds of the slowest rank's forward + backward; ranks beyond 2 oversubscribe the 2 cores.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, run_worker  # noqa: E402

H, HS = 8, 64


def closed_form(comm, cp):
    return (6 * cp - 4) if comm == "ring" else 8 * (cp - 1) / cp


class Counting:
    """The communicator, with the bytes it is handed to send to other ranks counted."""

    def __init__(self, comm):
        self.comm, self.sent = comm, 0
        self.size, self.rank = comm.size, comm.rank

    def isend(self, x, dest, tag=0):
        self.sent += x.nbytes
        return self.comm.isend(x, dest, tag=tag)

    def irecv(self, buf, source, tag=0):
        return self.comm.irecv(buf, source, tag=tag)

    def alltoall(self, x, out=None, algo="auto"):
        self.sent += x.nbytes * (self.size - 1) // self.size
        return self.comm.alltoall(x, out=out, algo=algo)


def worker(T: int, rounds: int):
    import numpy as np
    from mpi4py import MPI

    from pympar import kernels
    from pympar.comm import MPIComm
    from pympar.parallel.cp import RingAttentionCore, UlyssesAttentionCore

    kernels.set_num_threads(1)
    world = MPI.COMM_WORLD
    cp = world.size
    comm = MPIComm(world, name="cp", timeout=600)
    n = T // cp
    rng = np.random.default_rng(world.rank)
    qkv = rng.standard_normal((1, n, 3, H, HS)).astype(np.float32)
    dya = rng.standard_normal((1, n, H * HS)).astype(np.float32)
    rows = {}
    times = {"ring": [], "a2a": []}
    for r in range(rounds + 1):
        for name in ("ring", "a2a"):
            c = Counting(comm)
            core = RingAttentionCore(c) if name == "ring" else UlyssesAttentionCore(c, T)
            world.Barrier()
            t0 = time.perf_counter()
            ya, ctx = core.forward(qkv)
            core.backward(dya, ctx)
            dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if r:
                times[name].append(dt)
            rows[name] = c.sent
    u = n * H * HS * 4
    every = {name: world.allgather(rows[name]) for name in ("ring", "a2a")}      # each rank's bytes
    if world.rank == 0:
        out = [dict(comm=name, cp=cp, T=T, bytes_per_rank=max(every[name]), bytes_min_rank=min(every[name]),
                    unit_bytes=u, measured_units=max(every[name]) / u, closed_form_units=closed_form(name, cp),
                    seconds=statistics.median(times[name])) for name in ("ring", "a2a")]
        print("ROWS " + json.dumps(out), flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "cp_comm.json"))
    a = ap.parse_args(argv)
    cases = [(2, 512)] if a.quick else [(cp, T) for cp in (2, 4) for T in (2048, 4096, 8192)]
    rows = []
    for cp, T in cases:
        got = run_worker(cp, __file__, [T, 1 if a.quick else 3], timeout=1800)
        rows += got
        for r in got:
            print(f"cp={cp} T={T:>5} {r['comm']:>4}: {r['bytes_per_rank'] / 2**20:8.2f} MiB per rank "
                  f"({r['measured_units']:.2f} u, closed form {r['closed_form_units']:.2f} u), "
                  f"{1e3 * r['seconds']:8.1f} ms fwd+bwd", flush=True)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(dict(machine=machine(), heads=H, head_size=HS, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
