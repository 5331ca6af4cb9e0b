"""Context parallelism's attention traffic and time: the ring against Ulysses' all-to-alls.

    python bench/cp_comm.py                 # cp 2 and 4, T 2048-16384 (a few minutes on 2 cores)
    python bench/cp_comm.py --quick         # cp 2, T 512 (the smoke test)
    python bench/cp_comm.py --two-nodes     # cp 4, T 8192: ring, a2a and a2a+ring on 2 simulated nodes

Each row is one ``mpiexec -n cp`` launch of this file's worker: the attention core alone (the
runner's RingAttentionCore or UlyssesAttentionCore on a cp communicator), batch 1, 8 heads of 64,
float32, forward and backward of this rank's 2c = T/cp positions, the two cores alternating. Bytes:
every array this rank hands the communicator to send to another rank, counted by a wrapper around
its isend and alltoall (an all-to-all's own block stays home), against the closed forms, in units
of u = B x 2c x C x itemsize (this rank's share of one activation):

    ring   forward: the key/value block, cp - 1 hops (2u each); backward: the blocks again, and
           each block's dK/dV partial to its owner: the key rows its queries see, all 2c of them
           (2u) for a later rank's block, half (1u) for an earlier's -- rank i sends cp - 1 - i of
           2u and i of 1u                        -> 4 (cp - 1) u + (2 (cp - 1) - i) u: 6 (cp - 1) u
           on rank 0, the most, 5 (cp - 1) u on rank cp - 1, the least
    a2a    forward: q, k, v out and the output back, (cp - 1)/cp of each (4u); backward: the same
           4u the other way                      -> 8 (cp - 1)/cp u

At a fixed T per rank the ring's traffic grows with cp and Ulysses' does not. Time: the median
over rounds of the slowest rank's forward + backward; ranks beyond 2 oversubscribe the 2 cores.

``--two-nodes`` (issue 48's hybrid target): cp = 4 as 2 nodes of 2 ranks (PYMPAR_RANKS_PER_NODE=2),
once on shared memory and once with every message on MPICH's network module (MPIR_CVAR_NOLOCAL=1),
the ring, Ulysses over all 4 ranks and ``a2a+ring`` (Ulysses inside each node's pair, the ring of
the 2 nodes); bytes crossing between the two nodes are counted per destination.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, output_paths, run_worker  # noqa: E402

H, HS = 8, 64


def closed_form(comm, cp):
    """(the most, the least) units a rank sends (the docstring's forms)."""
    return (6 * (cp - 1), 5 * (cp - 1)) if comm == "ring" else (8 * (cp - 1) / cp,) * 2


class Counting:
    """The communicator, with the bytes it is handed to send to other ranks counted; ``node_of``
    (this communicator's rank -> node) also counts those that leave this rank's node (``across``)."""

    def __init__(self, comm, node_of=None):
        self.comm, self.sent, self.across = comm, 0, 0
        self.size, self.rank = comm.size, comm.rank
        self.node_of = node_of or (lambda r: 0)

    def isend(self, x, dest, tag=0):
        self.sent += x.nbytes
        self.across += x.nbytes if self.node_of(dest) != self.node_of(self.rank) else 0
        return self.comm.isend(x, dest, tag=tag)

    def irecv(self, buf, source, tag=0):
        return self.comm.irecv(buf, source, tag=tag)

    def alltoall(self, x, out=None, algo="auto"):
        block = x.nbytes // self.size
        self.sent += block * (self.size - 1)
        self.across += block * sum(self.node_of(d) != self.node_of(self.rank) for d in range(self.size))
        return self.comm.alltoall(x, out=out, algo=algo)


def worker(T: int, rounds: int, comms=("ring", "a2a")):
    import numpy as np
    from mpi4py import MPI

    from pympar import kernels
    from pympar.comm import MPIComm
    from pympar.parallel.cp import RingAttentionCore, UlyssesAttentionCore

    kernels.set_num_threads(1)
    world = MPI.COMM_WORLD
    cp = world.size
    comm = MPIComm(world, name="cp", timeout=600)
    per_node = 2                                 # the simulated nodes of --two-nodes: ranks 2j, 2j+1
    if "a2a+ring" in comms:                      # Ulysses inside a node's pair, the ring across nodes
        j, i = divmod(comm.rank, per_node)
        group = comm.split(j, key=i, name=f"cp/a2a{j}")
        across = comm.split(i, key=j, name=f"cp/ring{i}")
    n = T // cp
    rng = np.random.default_rng(world.rank)
    qkv = rng.standard_normal((1, n, 3, H, HS)).astype(np.float32)
    dya = rng.standard_normal((1, n, H * HS)).astype(np.float32)
    rows, across_bytes = {}, {}
    times = {name: [] for name in comms}
    for r in range(rounds + 1):
        for name in comms:
            if name == "a2a+ring":                # group ranks share a node; the ring's peers do not
                parts = [Counting(group, lambda g: 0), Counting(across, lambda k: k)]
                core = UlyssesAttentionCore(parts[0], T // across.size, ring_comm=parts[1])
            else:
                parts = [Counting(comm, lambda k: k // per_node)]
                core = RingAttentionCore(parts[0]) if name == "ring" else UlyssesAttentionCore(parts[0], T)
            world.Barrier()
            t0 = time.perf_counter()
            ya, ctx = core.forward(qkv)
            core.backward(dya, ctx)
            dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if r:
                times[name].append(dt)
            rows[name] = sum(c.sent for c in parts)
            across_bytes[name] = sum(c.across for c in parts)
    u = n * H * HS * 4
    every = {name: world.allgather(rows[name]) for name in comms}      # each rank's bytes
    cross = {name: world.allreduce(across_bytes[name]) for name in comms}
    if world.rank == 0:
        out = [dict(comm=name, cp=cp, T=T, bytes_per_rank=max(every[name]), bytes_min_rank=min(every[name]),
                    unit_bytes=u, measured_units=max(every[name]) / u, bytes_across_nodes=cross[name],
                    seconds=statistics.median(times[name]), rounds=times[name],
                    **(dict(zip(("closed_form_units", "closed_form_min_units"), closed_form(name, cp)))
                       if name != "a2a+ring" else {}))
               for name in comms]
        print("ROWS " + json.dumps(out), flush=True)


def two_nodes(a):
    """cp 4 on 2 simulated nodes, shared memory and the network module: -> rows, with the hybrid's
    speed-up over the faster pure variant per transport."""
    comms = ["ring", "a2a", "a2a+ring"]
    out = []
    for transport, extra in (("shared memory", {}), ("network (MPIR_CVAR_NOLOCAL=1)", {"MPIR_CVAR_NOLOCAL": "1"})):
        got = run_worker(4, __file__, [a.T, a.rounds, ",".join(comms)], timeout=3600,
                         env_extra={"PYMPAR_RANKS_PER_NODE": "2", **extra})
        by = {r["comm"]: r for r in got}
        best = min(by["ring"]["seconds"], by["a2a"]["seconds"])
        for r in got:
            r.update(transport=transport, speedup_vs_best_pure=best / r["seconds"])
            print(f"{transport:30s} cp=4 T={a.T} {r['comm']:>8}: {1e3 * r['seconds']:8.1f} ms fwd+bwd, "
                  f"{r['bytes_per_rank'] / 2**20:7.2f} MiB per rank, {r['bytes_across_nodes'] / 2**20:7.2f} MiB "
                  f"across the nodes; {r['speedup_vs_best_pure']:.2f}x the faster pure variant", flush=True)
        out += got
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), int(argv[2]), *([tuple(argv[3].split(","))] if len(argv) > 3 else []))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--two-nodes", action="store_true", help="cp 4 on 2 simulated nodes: the hybrid's target")
    ap.add_argument("--T", type=int, default=8192, help="--two-nodes: sequence length (default 8192)")
    ap.add_argument("--rounds", type=int, default=5, help="--two-nodes: timed rounds (default 5)")
    ap.add_argument("--json", default=None, help="default bench/results/cp_comm.json (cp_hybrid.json with --two-nodes; "
                                                 "--quick: under bench/results/quick/)")
    a = ap.parse_args(argv)
    name = "cp_hybrid" if a.two_nodes else "cp_comm"
    a.json = a.json or str(output_paths(name, a.quick)[0])
    if a.two_nodes:
        rows = two_nodes(a)
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(dict(machine=machine(), heads=H, head_size=HS, rows=rows), indent=1) + "\n")
        return 0
    cases = [(2, 512)] if a.quick else [(cp, T) for cp in (2, 4) for T in (2048, 4096, 8192, 16384)]
    rows = []
    for cp, T in cases:
        got = run_worker(cp, __file__, [T, 1 if a.quick else 3], timeout=1800)
        rows += got
        for r in got:
            print(f"cp={cp} T={T:>5} {r['comm']:>4}: {r['bytes_per_rank'] / 2**20:8.2f} MiB per rank "
                  f"({r['measured_units']:.2f} u, closed form {r['closed_form_units']:.2f} u; least "
                  f"{r['bytes_min_rank'] / r['unit_bytes']:.2f} u, {r['closed_form_min_units']:.2f} u), "
                  f"{1e3 * r['seconds']:8.1f} ms fwd+bwd", flush=True)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(dict(machine=machine(), heads=H, head_size=HS, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
