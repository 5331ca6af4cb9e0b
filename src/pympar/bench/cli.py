"""Collective microbenchmarks in the style of nccl-tests and the OSU micro-benchmarks.

    mpiexec -n 4 python -m pympar.bench allreduce -b 8 -e 128M -f 2 -n 20 -w 5 -c 1 \\
        --algo all --dtype float32 --op sum --backend mpi --json out.json
    mpiexec -n 2 python -m pympar.bench latency      # osu_latency: one-way, pympar and mpi4py
    mpiexec -n 2 python -m pympar.bench bw           # osu_bw: windowed streaming bandwidth

Collectives, nccl-tests columns (default): size(B) count type redop algo, then out-of-place
and in-place time(us), algbw(GB/s) = size/time, busbw(GB/s) = algbw x factor (allreduce
2(n-1)/n; reduce_scatter, allgather, alltoall(v) (n-1)/n; broadcast, sendrecv 1) and #wrong
(elements off the NumPy reference, with -c 1). Time is the mean over -n iterations after
-w warm-up ones, the slowest rank's. ``--rounds R`` times every choice R times per size,
alternating (choice 1, 2, ..., then again), and reports each choice's fastest round: two
choices are then compared at the same moments of a noisy machine, not minutes apart. ``--format osu``: OSU's columns instead, average,
minimum and maximum over the ranks of each rank's mean latency (us). ``--algo all`` runs
auto and every pympar algorithm, the MPI library's own call made directly through mpi4py (row
"library"), and, for allreduce when torch imports, torch.distributed's gloo
("torch-gloo"); ``auto`` rows name what auto ran, e.g. auto(shm). ``--explain`` prints,
per size, what auto chose and the measured times behind it. ``--tune FILE`` adds this
run's fastest choice per size bucket (the library's call 'mpi' or a pympar algorithm) to a
tuning file for this machine and communicator shape (use it with PYMPAR_TUNING=FILE).

latency and bw (ranks 0 and 1; sizes default 0 B to 4 MiB): columns are pympar's
Communicator and mpi4py's own calls, and ratio = pympar's time over mpi4py's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from .. import backend
from ..comm import tuning
from ..config import check_output_file, start_application
from .runners import BUSBW, IN_PLACE, Case

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "alltoallv", "sendrecv")
POINT_TO_POINT = ("latency", "bw")
REDUCING = ("allreduce", "reduce_scatter")       # the collectives --op applies to


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m pympar.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collective", choices=COLLECTIVES + POINT_TO_POINT)
    p.add_argument("-b", "--minbytes", default=None, help="smallest message size (suffix K, M, G allowed; "
                   "default 8, latency/bw 0)")
    p.add_argument("-e", "--maxbytes", default=None, help="largest message size (default 32M, latency/bw 4M)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="multiply the size by this each step (default 2)")
    p.add_argument("-n", "--iters", type=int, default=None, help="timed iterations per size (default 20; "
                   "latency/bw 10000 and 100)")
    p.add_argument("-w", "--warmup_iters", type=int, default=None, help="untimed iterations before them "
                   "(default 5; latency/bw 100 and 10)")
    p.add_argument("--rounds", type=int, default=1, help="collectives: time the choices R times per size, "
                   "alternating, and report each one's fastest round (default 1)")
    p.add_argument("--large-iters", type=int, default=None, help="latency/bw: iterations above 8 KiB "
                   "(default 1000 and 20)")
    p.add_argument("--window", type=int, default=64, help="bw: sends in flight per iteration (default 64)")
    p.add_argument("--format", default="nccl", choices=("nccl", "osu"), help="collectives: nccl-tests "
                   "columns or OSU's (avg/min/max latency over the ranks)")
    p.add_argument("--explain", action="store_true", help="print what algo=auto runs per size and why")
    p.add_argument("--on-timeout", default="abort", choices=("abort", "raise"), help="a call past its deadline "
                   "ends the job with the report (abort, as nccl-tests; lets auto use the library's blocking "
                   "call, row 'blocking') or raises CommTimeoutError (raise: auto polls nonblocking calls only)")
    p.add_argument("-c", "--check", type=int, default=1, help="1 (default): count the elements that differ from the reference; 0: skip the check")
    p.add_argument("--algo", default="auto", help="auto (default) | all | one algorithm name | a comma-separated list")
    p.add_argument("--dtype", default="float32", help="float32 (default) float64 float16 bfloat16 int32 int64")
    p.add_argument("--op", default=None, choices=("sum", "avg", "max", "min"),
                   help="allreduce and reduce_scatter only (default sum)")
    p.add_argument("--backend", default="mpi", choices=("mpi", "nccl"), help="mpi (default); nccl needs a GPU and CuPy (implemented, not yet run on a GPU)")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--tune", default=None, metavar="FILE", help="add the fastest choice per size to this "
                   "tuning file (for algo=auto via PYMPAR_TUNING=FILE)")
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
        if coll == "alltoall":
            mc.Alltoall(wire(x), wire(out))
            return out
        if coll == "alltoallv":                  # the library's v-call, equal counts as the case's
            (sb, st), (rb, rt) = wire(x), wire(out)
            k = len(sb) // n
            counts, displs = [k] * n, [i * k for i in range(n)]
            mc.Alltoallv([sb, (counts, displs), st], [rb, (counts, displs), rt])
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
    if getattr(comm, "on_timeout", None) == "abort" and coll in _AUTO_VERBS:
        avail.insert(avail.index("mpi") + 1, "blocking")
    if "shm" in avail and not comm.topology().single_node:
        avail.remove("shm")
    if args.algo == "all":                       # auto: for alltoallv and sendrecv, pympar's one call
        names = ["auto"] + avail + ["library"]
        if coll == "allreduce" and not args.no_torch and args.dtype != "bfloat16":
            from . import torch_peer

            if torch_peer.available():
                names.append("torch-gloo")
        return names
    names = args.algo.split(",")
    if "blocking" in names and "blocking" not in avail:
        raise SystemExit("--algo blocking (the library's blocking call) needs --on-timeout abort: a blocking call "
                         "cannot raise at its deadline, only end the job")
    for a in names:
        if a not in avail + ["auto", "library", "torch-gloo"]:
            raise SystemExit(f"--algo {a!r} is not an algorithm of {coll}: expected all, auto, library or one of {avail}")
    return names


def time_one(case, algo, in_place, args, lib):
    """(min, avg, max) over the ranks of each rank's mean time per call, in seconds."""
    from mpi4py import MPI

    comm = case.comm
    call = (lambda: lib(case, in_place)) if lib is not None else (lambda: case.run(algo, in_place))
    for _ in range(args.warmup_iters):
        call()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        call()
    dt = (time.perf_counter() - t0) / max(1, args.iters)
    mc = comm.mpi_comm
    return (float(mc.allreduce(dt, op=MPI.MIN)), float(mc.allreduce(dt, op=MPI.SUM)) / comm.size,
            float(mc.allreduce(dt, op=MPI.MAX)))


def _defaults(args):
    p2p = args.collective in POINT_TO_POINT
    for name, coll_default, p2p_default in (("minbytes", "8", "0"), ("maxbytes", "32M", "4M"),
                                            ("iters", 20, 10000 if args.collective == "latency" else 100),
                                            ("warmup_iters", 5, 100 if args.collective == "latency" else 10),
                                            ("large_iters", None, 1000 if args.collective == "latency" else 20)):
        if getattr(args, name) is None:
            setattr(args, name, p2p_default if p2p else coll_default)
    return p2p


def _sizes(args):
    sizes, s = [], parse_size(args.minbytes)
    while s <= parse_size(args.maxbytes):
        sizes.append(s)
        s = max(s + 1, int(s * args.stepfactor))
    return sizes


def _write_json(args, comm, **fields):
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(nranks=comm.size, backend=args.backend, iters=args.iters, warmup=args.warmup_iters,
                           rounds=args.rounds, **fields), f, indent=1)


def _check(ap, args) -> None:
    """Every flag's value before anything runs: one "error:" line (ap.error, status 2) on every rank,
    the same verdict everywhere (no communication)."""
    try:
        lo, hi = parse_size(args.minbytes), parse_size(args.maxbytes)
    except ValueError:
        ap.error(f"-b {args.minbytes} / -e {args.maxbytes}: sizes are bytes with an optional K, M or G (e.g. 8, 64K, 1M)")
    if lo < 0 or hi < lo:
        ap.error(f"-b {args.minbytes} -e {args.maxbytes}: need 0 <= minbytes <= maxbytes")
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    if mem and 4 * hi > mem:                    # a message's input, output and reference buffers per rank
        ap.error(f"-e {args.maxbytes}: a message of {hi:,} bytes needs about 4x that per rank; this machine has "
                 f"{mem:,} bytes")
    for name, ok, want in (("stepfactor", 1 < args.stepfactor < float("inf"), "a finite number > 1"), ("iters", args.iters >= 1, ">= 1"),
                           ("warmup_iters", args.warmup_iters >= 0, ">= 0"), ("rounds", args.rounds >= 1, ">= 1"),
                           ("window", args.window >= 1, ">= 1"), ("check", args.check in (0, 1), "0 or 1"),
                           ("large_iters", args.large_iters is None or args.large_iters >= 1, ">= 1")):
        if not ok:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be {want}")
    if args.op is not None and args.collective not in REDUCING:
        ap.error(f"--op applies to allreduce and reduce_scatter, not {args.collective}")
    args.op = args.op or "sum"
    try:
        backend.dtype(args.dtype)
    except (TypeError, ValueError):
        ap.error(f"--dtype {args.dtype!r}: expected float32, float64, float16, bfloat16, int32 or int64")
    for flag, path in (("--json", args.json), ("--tune", args.tune)):
        if not path:
            continue
        try:
            check_output_file(path)
            if flag == "--tune":
                tuning.check_target(path)
        except ValueError as e:
            ap.error(f"{flag} {path}: {e}")


def main(argv=None):
    start_application("pympar.bench", timed=True)
    ap = build_parser()
    args = ap.parse_args(argv)
    p2p = _defaults(args)
    _check(ap, args)
    if args.backend == "nccl":
        if p2p:
            raise SystemExit(f"pympar.bench {args.collective}: --backend nccl is for the collectives")
        from ..comm.nccl import NCCLComm

        try:
            comm, xp = NCCLComm(), backend.get_xp("cuda")
        except (RuntimeError, ImportError) as e:
            ap.error(f"--backend nccl: {e}")
    else:
        from mpi4py import MPI

        from ..comm import MPIComm

        comm, xp = MPIComm(MPI.COMM_WORLD, name="world", on_timeout=args.on_timeout), np
    if p2p:
        from . import p2p as p2p_bench

        rows = p2p_bench.run(args, comm, _sizes(args))
        _write_json(args, comm, collective=args.collective, window=args.window, rows=rows)
        bad = comm.mpi_comm.bcast(any(r["wrong"] > 0 for r in rows) if comm.rank == 0 else None, 0)
        if comm.rank == 0:
            print(f"# Wrong bytes received : {'FAILED' if bad else '0 OK'}")
        return 1 if bad else 0
    dtype = backend.dtype(args.dtype)
    coll, n = args.collective, comm.size
    names = ["nccl"] if args.backend == "nccl" else algorithms(args, comm)
    if args.tune and coll in _AUTO_VERBS and hasattr(comm, "candidates"):
        names += [a for a in comm.candidates(coll) if a not in names]     # a tuning file weighs every choice
    gloo = None
    if "torch-gloo" in names:
        from .torch_peer import GlooAllreduce

        gloo = GlooAllreduce(comm.mpi_comm)

    def gloo_call(case, in_place=True):
        t = gloo.tensor(case.x)
        gloo.allreduce(t, args.op)
        return case.x

    sizes = _sizes(args)
    rows = []
    osu = args.format == "osu"
    redop = args.op if coll in REDUCING else "none"                            # (nccl-tests' column)
    if comm.rank == 0:
        print(f"# pympar.bench {coll}: nranks {n}, backend {args.backend}, iters {args.iters}, warmup {args.warmup_iters}"
              + (f", fastest of {args.rounds} alternating rounds" if args.rounds > 1 else ""))
        if osu:
            print(f"# {'Size':>10} {'algo':>24} {'placement':>9} {'Avg Latency(us)':>16} {'Min Latency(us)':>16} "
                  f"{'Max Latency(us)':>16} {'Iterations':>10} {'#wrong':>7}")
        else:
            print(f"#{'size':>11} {'count':>11} {'type':>9} {'redop':>6} {'algo':>24}  |"
                  f"{'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>7} |{'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>7}")
            print(f"#{'(B)':>11} {'(elements)':>11} {'':>9} {'':>6} {'':>24}  |"
                  f"{'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7} |{'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}")
    factor = BUSBW[coll](n)
    explained = []
    if sizes and args.warmup_iters:   # the job's first calls (windows made, pages touched, ranks in step): untimed
        first = Case(comm, coll, sizes[0], dtype, args.op, xp)
        if first.count or coll not in ("allgather", "alltoall", "alltoallv"):
            for algo in names:
                if algo not in ("library", "torch-gloo"):
                    for _ in range(args.warmup_iters):
                        first.run(None if algo == "nccl" else algo, False)
        comm.barrier()
    for size in sizes:
        case = Case(comm, coll, size, dtype, args.op, xp)
        if case.count == 0 and coll in ("allgather", "alltoall", "alltoallv"):
            continue
        calls = {algo: library_call(coll, args.op) if algo == "library" else (gloo_call if algo == "torch-gloo" else None)
                 for algo in names}
        places = {algo: [ip for ip in (False, True) if not (ip and coll not in IN_PLACE)
                         and not (algo == "torch-gloo" and not ip)] for algo in names}
        timed = {}
        for _ in range(max(1, args.rounds)):      # alternating rounds: every choice timed at the same moments
            for algo in names:
                for in_place in places[algo]:
                    t = time_one(case, None if algo in ("nccl",) else algo, in_place, args, calls[algo])
                    timed.setdefault((algo, in_place), []).append(t)
        for algo in names:
            lib = calls[algo]
            cells = []
            for in_place in (False, True):
                if in_place not in places[algo]:
                    cells.append(None)
                    continue
                rounds = timed[(algo, in_place)]
                tmin, tavg, tmax = min(rounds, key=lambda t: t[2])    # the fastest round (by its slowest rank)
                wrong = -1
                if args.check:
                    w = case.wrong(algo, in_place, None if lib is None else (lambda c, check=False, ip=in_place: lib(c, ip)))
                    wrong = int(comm.mpi_comm.allreduce(w))
                algbw = case.nbytes / tmax / 1e9 if tmax > 0 else 0.0
                cells.append(dict(time_us=tmax * 1e6, min_us=tmin * 1e6, avg_us=tavg * 1e6, algbw=algbw,
                                  busbw=algbw * factor, wrong=wrong))
                if len(rounds) > 1:
                    cells[-1]["rounds_us"] = [t[2] * 1e6 for t in rounds]
                rows.append(dict(bytes=case.nbytes, count=case.count, type=args.dtype, redop=redop, algo=algo,
                                 placement="in" if in_place else "out", **cells[-1]))
            label = algo
            if algo == "auto" and coll in _AUTO_VERBS and hasattr(comm, "explain"):
                d = comm.explain(coll, case.nbytes, args.dtype, args.op)      # decided in the warm-up
                label = f"auto({d.algo})"
                for r in rows[-len([c for c in cells if c is not None]):]:
                    r["chosen"] = d.algo
                    if d.times_us:
                        r["decision_us"] = {a: round(t, 3) for a, t in d.times_us.items()}   # what auto measured
                if args.explain:
                    explained.append(d)
            if comm.rank == 0:
                if osu:
                    for c, place in zip(cells, ("out", "in")):
                        if c is not None:
                            print(f"  {case.nbytes:>10} {label:>24} {place:>9} {c['avg_us']:16.2f} {c['min_us']:16.2f} "
                                  f"{c['time_us']:16.2f} {args.iters:>10} {c['wrong'] if c['wrong'] >= 0 else 'N/A':>7}")
                else:
                    txt = ""
                    for c in cells:
                        txt += (f"|{'N/A':>10} {'':>7} {'':>7} {'':>7} " if c is None else
                                f"|{c['time_us']:10.1f} {c['algbw']:7.2f} {c['busbw']:7.2f} {c['wrong'] if c['wrong'] >= 0 else 'N/A':>7} ")
                    print(f" {case.nbytes:11d} {case.count:11d} {args.dtype:>9} {redop:>6} {label:>24}  {txt}")
        sys.stdout.flush()
    if args.explain and comm.rank == 0:
        for d in explained:
            print("# " + str(d).replace("\n", "\n# "))
    avg = {}
    for algo in names:
        bws = [r["busbw"] for r in rows if r["algo"] == algo]
        avg[algo] = sum(bws) / len(bws) if bws else 0.0
    shape = comm.shape_key() if hasattr(comm, "shape_key") else None     # collective: all ranks
    if comm.rank == 0:
        for algo in names:
            print(f"# Avg bus bandwidth    : {avg[algo]:.4f}  ({algo})")
        wrong = sum(r["wrong"] for r in rows if r["wrong"] > 0)
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        _write_json(args, comm, collective=coll, dtype=args.dtype, op=args.op, shape=shape, rows=rows, avg_busbw=avg)
        if args.tune:
            write_tuning(args.tune, rows, coll, args.dtype, shape)
    if gloo is not None:
        gloo.close()
    bad = any(r["wrong"] > 0 for r in rows)
    return 1 if bad else 0


_AUTO_VERBS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall")


def write_tuning(path, rows, coll, dtype, shape):
    """The run's rows as tuning-file entries: per size, every choice auto has ('mpi' is the
    library's call through pympar; the direct 'library' row, gloo and auto are not choices)."""
    from ..comm.tuning import write_file

    by_size = {}
    for r in rows:
        if r["placement"] == "out" and r["algo"] not in ("library", "torch-gloo", "auto", "nccl"):
            by_size.setdefault(r["bytes"], {})[r["algo"]] = r["time_us"] * 1e-6
    if coll not in _AUTO_VERBS or shape is None or not by_size:
        print(f"# --tune: nothing to write ({coll} has no algo=auto choice or no algorithm ran)")
        return
    write_file(path, shape, coll, dtype, by_size)
    print(f"# added {len(by_size)} sizes of {coll} {dtype} at shape {shape} to tuning file {path} "
          f"(use PYMPAR_TUNING={path})")
