"""Point-to-point benchmarks in the manner of the OSU micro-benchmarks (osu_latency, osu_bw).

latency: ranks 0 and 1 ping-pong one message per iteration; the one-way latency is half
the round trip, averaged over the timed iterations (osu_latency). bw: rank 0 posts a window
of nonblocking sends of one size, rank 1 the matching receives, then rank 1 answers with a
4-byte acknowledgement; bandwidth is size x window x iterations over the time (osu_bw).
Other ranks wait at the end. Each size runs through pympar's Communicator (``pympar``:
``send``/``recv``/``isend``/``irecv``) and through mpi4py's own calls on a duplicate of the
same communicator (``mpi4py``), the peer a user of mpi4py would compare with.
"""
from __future__ import annotations

import time

import numpy as np

SMALL = 8192          # sizes up to here run -n iterations, larger ones --large-iters (OSU: 10000 / 1000)


def _pattern(nbytes, salt):
    return ((np.arange(nbytes, dtype=np.int64) * 7 + salt) % 251).astype(np.uint8)


class Peer:
    """send/recv/isend/irecv/waitall of one implementation on a pair of buffers."""

    def __init__(self, name, comm):
        self.name = name
        if name == "pympar":
            self.c = comm
            self.send = lambda b, d, t=1: comm.send(b, d, t)
            self.recv = lambda b, s, t=1: comm.recv(b, s, t)
            self.isend = lambda b, d, t=1: comm.isend(b, d, t)
            self.irecv = lambda b, s, t=1: comm.irecv(b, s, t)
            self.waitall = lambda reqs: [r.wait() for r in reqs]
        else:
            from mpi4py import MPI

            c = comm.mpi_comm.Dup()
            self.c = c
            self.send = lambda b, d, t=1: c.Send(b, d, t)
            self.recv = lambda b, s, t=1: c.Recv(b, s, t)
            self.isend = lambda b, d, t=1: c.Isend(b, d, t)
            self.irecv = lambda b, s, t=1: c.Irecv(b, s, t)
            self.waitall = MPI.Request.Waitall

    def free(self):
        if self.name != "pympar":
            self.c.Free()


def latency(peer, rank, nbytes, iters, warmup, check):
    """One-way latency in seconds on rank 0 (None elsewhere), and wrong bytes seen."""
    sbuf = _pattern(nbytes, rank)
    rbuf = np.zeros(nbytes, np.uint8)
    t0 = 0.0
    for i in range(warmup + iters):
        if i == warmup:
            t0 = time.perf_counter()
        if rank == 0:
            peer.send(sbuf, 1)
            peer.recv(rbuf, 1)
        elif rank == 1:
            peer.recv(rbuf, 0)
            peer.send(sbuf, 0)
    dt = (time.perf_counter() - t0) / max(iters, 1) / 2
    wrong = int(np.count_nonzero(rbuf != _pattern(nbytes, 1 - rank))) if check and rank < 2 else 0
    return (dt if rank == 0 else None), wrong


def bandwidth(peer, rank, nbytes, iters, warmup, window, check):
    """Bandwidth in bytes/s on rank 0 (None elsewhere), and wrong bytes seen on rank 1."""
    sbuf = _pattern(nbytes, 0)
    rbufs = [np.zeros(nbytes, np.uint8) for _ in range(window)] if rank == 1 else []
    ack = np.zeros(4, np.uint8)
    t0 = 0.0
    for i in range(warmup + iters):
        if i == warmup:
            t0 = time.perf_counter()
        if rank == 0:
            peer.waitall([peer.isend(sbuf, 1, 100) for _ in range(window)])
            peer.recv(ack, 1, 101)
        elif rank == 1:
            peer.waitall([peer.irecv(b, 0, 100) for b in rbufs])
            peer.send(ack, 0, 101)
    dt = time.perf_counter() - t0
    wrong = 0
    if check and rank == 1:
        want = _pattern(nbytes, 0)
        wrong = sum(int(np.count_nonzero(b != want)) for b in rbufs)
    return (nbytes * window * iters / dt if rank == 0 and dt > 0 else None), wrong


def run(args, comm, sizes):
    """Rows of ``python -m pympar.bench latency|bw``; prints the OSU-style table on rank 0."""
    from mpi4py import MPI

    if comm.size < 2:
        raise SystemExit(f"pympar.bench {args.collective} needs at least 2 ranks (ranks 0 and 1 exchange; "
                         f"run it with mpiexec -n 2)")
    rank, kind = comm.rank, args.collective
    peers = [Peer(name, comm) for name in ("pympar", "mpi4py")]
    rows = []
    if rank == 0:
        unit = "Latency (us)" if kind == "latency" else "Bandwidth (MB/s)"
        extra = "" if kind == "latency" else f", window {args.window}"
        print(f"# pympar.bench {kind} (OSU {'osu_latency' if kind == 'latency' else 'osu_bw'} style): ranks 0 <-> 1 "
              f"of {comm.size}{extra}, iters {args.iters} (> {SMALL} B: {args.large_iters}), warmup {args.warmup_iters}")
        print(f"# {'Size':>10} " + " ".join(f"{p.name + ' ' + unit:>24}" for p in peers) + f" {'ratio':>7}")
    mc = comm.mpi_comm
    for size in sizes:
        iters = args.iters if size <= SMALL else args.large_iters
        warm = args.warmup_iters if size <= SMALL else max(1, args.warmup_iters // 10)
        vals = []
        for p in peers:
            mc.Barrier()
            if kind == "latency":
                v, wrong = latency(p, rank, size, iters, warm, args.check)
                v = None if v is None else v * 1e6
            else:
                v, wrong = bandwidth(p, rank, size, iters, warm, args.window, args.check)
                v = None if v is None else v / 1e6
            wrong = int(mc.allreduce(wrong, op=MPI.SUM))
            vals.append(v)
            if rank == 0:
                rows.append(dict(bytes=size, impl=p.name, iters=iters, wrong=wrong,
                                 **({"latency_us": v} if kind == "latency" else {"bandwidth_MBps": v})))
        if rank == 0:
            a, b = vals
            ratio = (a / b if kind == "latency" else b / a) if a and b else float("nan")
            print(f"  {size:>10} " + " ".join(f"{v:>24.2f}" for v in vals) + f" {ratio:>7.2f}")
    for p in peers:
        p.free()
    return rows
