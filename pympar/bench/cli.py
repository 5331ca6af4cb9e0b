"""Collective microbenchmarks in the style of nccl-tests, for pympar's algorithms side by side.

    mpiexec -n 4 python -m pympar.bench allreduce -b 8 -e 128M -f 2 -n 20 -w 5 -c 1 \\
        --algo all --dtype float32 --op sum --backend mpi --json out.json

Columns: size(B) count type redop algo, then out-of-place and in-place time(us),
algbw(GB/s) = size/time, busbw(GB/s) = algbw x factor (allreduce 2(n-1)/n; reduce_scatter,
allgather, alltoall(v) (n-1)/n; broadcast, sendrecv 1) and #wrong (elements off the NumPy
reference, with -c 1). Time is the mean over -n iterations after -w warm-up ones, the
slowest rank's. ``--algo all`` runs every pympar algorithm, the MPI library's own call
made directly through mpi4py (row "library"), and, for allreduce when torch imports,
torch.distributed's gloo ("torch-gloo"). ``--tune FILE`` writes the fastest algorithm per
size as an algo="auto" table (use it with PYMPAR_TUNING=FILE).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from .. import backend
from .runners import BUSBW, IN_PLACE, Case

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "alltoallv", "sendrecv")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m pympar.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collective", choices=COLLECTIVES)
    p.add_argument("-b", "--minbytes", default="8", help="smallest message size (suffix K, M, G allowed)")
    p.add_argument("-e", "--maxbytes", default="32M", help="largest message size")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="multiply the size by this each step")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations before them")
    p.add_argument("-c", "--check", type=int, default=1, help="1: count elements that differ from the reference")
    p.add_argument("--algo", default="auto", help="auto | all | one algorithm name | a comma-separated list")
    p.add_argument("--dtype", default="float32", help="float32 float64 float16 bfloat16 int32 int64")
    p.add_argument("--op", default="sum", help="sum avg max min (reductions only)")
    p.add_argument("--backend", default="mpi", choices=("mpi", "nccl"), help="nccl needs a GPU and CuPy")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--tune", default=None, metavar="FILE", help="write an algo=auto table from the results")
    p.add_argument("--no-torch", action="store_true", help="leave torch.distributed gloo out of --algo all")
    return p


def library_call(coll, op):
    """The MPI library's own collective through mpi4py, on the benchmark's buffers."""
    from mpi4py import MPI

    from ..comm.dtypes import finish_avg, mpi_op, wire

    def run(case, in_place=False):
        mc = case.comm.mpi_comm
        x, out, n, r = case.x, case.out, case.comm.size, case.comm.rank
        if coll == "allreduce":
            if in_place:
                mc.Allreduce(MPI.IN_PLACE, wire(x), mpi_op(op, x.dtype))
                res = x
            else:
                mc.Allreduce(wire(x), wire(out), mpi_op(op, x.dtype))
                res = out
            return finish_avg(res, n) if op == "avg" else res
        if coll == "reduce_scatter":
            counts = [len(b) for b in np.array_split(np.arange(x.size), n)]
            mc.Reduce_scatter(wire(x), wire(out), counts, mpi_op(op, x.dtype))
            return finish_avg(out, n) if op == "avg" else out
        if coll == "allgather":
            mc.Allgather(wire(x), wire(out))
            return out
        if coll == "broadcast":
            mc.Bcast(wire(x), 0)
            return x
        if coll in ("alltoall", "alltoallv"):
            mc.Alltoall(wire(x), wire(out))
            return out
        if coll == "sendrecv":
            mc.Sendrecv(wire(x), (r + 1) % n, 0, wire(out), (r - 1) % n, 0)
            return out
        raise ValueError(coll)

    return run


def algorithms(args, comm):
    from ..comm.mpi import ALGOS

    coll = args.collective
    avail = list(ALGOS.get(coll, ()))
    if "shm" in avail and not comm.topology().single_node:
        avail.remove("shm")
    if args.algo == "all":
        names = avail + ["library"]
        if coll == "allreduce" and not args.no_torch and args.dtype != "bfloat16":
            from . import torch_peer

            if torch_peer.available():
                names.append("torch-gloo")
        return names
    names = args.algo.split(",")
    for a in names:
        if a not in avail + ["auto", "library", "torch-gloo"]:
            raise SystemExit(f"--algo {a!r} is not an algorithm of {coll}: expected all, auto, library or one of {avail}")
    return names


def time_one(case, algo, in_place, args, lib):
    comm = case.comm
    call = (lambda: lib(case, in_place)) if lib is not None else (lambda: case.run(algo, in_place))
    for _ in range(args.warmup_iters):
        call()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        call()
    dt = (time.perf_counter() - t0) / max(1, args.iters)
    return float(comm.mpi_comm.allreduce(dt, op=__import__("mpi4py.MPI", fromlist=["MAX"]).MAX))


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.backend == "nccl":
        from ..comm.nccl import NCCLComm

        comm, xp = NCCLComm(), backend.get_xp("cuda")
    else:
        from ..comm import world

        comm, xp = world(), np
    dtype = backend.dtype(args.dtype)
    coll, n = args.collective, comm.size
    names = ["nccl"] if args.backend == "nccl" else algorithms(args, comm)
    gloo = None
    if "torch-gloo" in names:
        from .torch_peer import GlooAllreduce

        gloo = GlooAllreduce(comm.mpi_comm)

    def gloo_call(case, in_place=True):
        t = gloo.tensor(case.x)
        gloo.allreduce(t, args.op)
        return case.x

    sizes, s = [], parse_size(args.minbytes)
    while s <= parse_size(args.maxbytes):
        sizes.append(s)
        s = max(s + 1, int(s * args.stepfactor))
    rows = []
    if comm.rank == 0:
        print(f"# pympar.bench {coll}: nranks {n}, backend {args.backend}, iters {args.iters}, warmup {args.warmup_iters}")
        print(f"#{'size':>11} {'count':>11} {'type':>9} {'redop':>6} {'algo':>19}  |"
              f"{'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>7} |{'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>7}")
        print(f"#{'(B)':>11} {'(elements)':>11} {'':>9} {'':>6} {'':>19}  |"
              f"{'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7} |{'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}")
    factor = BUSBW[coll](n)
    for size in sizes:
        case = Case(comm, coll, size, dtype, args.op, xp)
        if case.count == 0 and coll in ("allgather", "alltoall", "alltoallv"):
            continue
        for algo in names:
            lib = library_call(coll, args.op) if algo == "library" else (gloo_call if algo == "torch-gloo" else None)
            cells = []
            for in_place in (False, True):
                if in_place and coll not in IN_PLACE:
                    cells.append(None)
                    continue
                if algo == "torch-gloo" and not in_place:
                    cells.append(None)
                    continue
                t = time_one(case, None if algo in ("nccl",) else algo, in_place, args, lib)
                wrong = -1
                if args.check:
                    w = case.wrong(algo, in_place, None if lib is None else (lambda c, check=False, ip=in_place: lib(c, ip)))
                    wrong = int(comm.mpi_comm.allreduce(w))
                algbw = case.nbytes / t / 1e9 if t > 0 else 0.0
                cells.append(dict(time_us=t * 1e6, algbw=algbw, busbw=algbw * factor, wrong=wrong))
                rows.append(dict(bytes=case.nbytes, count=case.count, type=args.dtype, redop=args.op, algo=algo,
                                 placement="in" if in_place else "out", **cells[-1]))
            if comm.rank == 0:
                txt = ""
                for c in cells:
                    txt += (f"|{'N/A':>10} {'':>7} {'':>7} {'':>7} " if c is None else
                            f"|{c['time_us']:10.1f} {c['algbw']:7.2f} {c['busbw']:7.2f} {c['wrong'] if c['wrong'] >= 0 else 'N/A':>7} ")
                print(f" {case.nbytes:11d} {case.count:11d} {args.dtype:>9} {args.op:>6} {algo:>19}  {txt}")
        sys.stdout.flush()
    avg = {}
    for algo in names:
        bws = [r["busbw"] for r in rows if r["algo"] == algo]
        avg[algo] = sum(bws) / len(bws) if bws else 0.0
    single_node = comm.topology().single_node if hasattr(comm, "topology") else True  # collective: all ranks
    if comm.rank == 0:
        for algo in names:
            print(f"# Avg bus bandwidth    : {avg[algo]:.4f}  ({algo})")
        wrong = sum(r["wrong"] for r in rows if r["wrong"] > 0)
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(collective=coll, nranks=n, backend=args.backend, dtype=args.dtype, op=args.op,
                               iters=args.iters, warmup=args.warmup_iters, rows=rows, avg_busbw=avg), f, indent=1)
        if args.tune:
            write_tuning(args.tune, rows, coll, single_node)
    if gloo is not None:
        gloo.close()
    bad = any(r["wrong"] > 0 for r in rows)
    return 1 if bad else 0


def write_tuning(path, rows, coll, single_node):
    from ..comm.tuning import table_from_results

    ours = [r for r in rows if r["placement"] == "out" and r["algo"] not in ("library", "torch-gloo", "auto")]
    table = {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    for c, by_topo in table_from_results(ours, coll, single_node).items():
        table.setdefault(c, {}).update(by_topo)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    print(f"# wrote algo=auto table for {coll} to {path} (use PYMPAR_TUNING={path})")
