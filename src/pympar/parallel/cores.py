"""Each rank's share of its node's cores: how many kernel and BLAS threads it runs, and where.

A process started by mpiexec gets the BLAS's own default, one thread per core of the machine,
and every rank on the node does the same: four ranks on a 2-core laptop then run eight busy
threads, and a step takes several times as long. ``share_cores(comm)`` is what pympar.train
does at start-up, for any program that runs pympar's modules under mpiexec (a benchmark, a
user's own training loop):

    from pympar.config import apply_environment
    from pympar.parallel.cores import share_cores
    env = apply_environment()
    n, why = share_cores(MPI.COMM_WORLD, env.threads, env.threads_from)

Unless ``threads`` is given (a flag or $PYMPAR_NUM_THREADS/$OMP_NUM_THREADS, read by the
application), each rank takes (the cores its node's ranks may run on: the union of their CPU
affinity masks, so a Slurm or cgroup limit counts, ``os.cpu_count()`` does not) // (the ranks
on the node), at least 1. When the node's ranks times their threads exceed its cores, kernel
threads never spin waiting. Collective over the node: every rank calls it at the same point.
"""
from __future__ import annotations

import os

from .. import kernels


def _mpi_comm(comm):
    """The mpi4py communicator of a pympar MPIComm, or ``comm`` itself (an mpi4py one)."""
    return getattr(comm, "mpi_comm", comm)


def node_share(comm, threads: int = 0, threads_from: str = "", bind: str = "none") -> tuple:
    """(threads per rank, why) for this rank of ``comm`` (see the module docstring); sets
    nothing but the kernels' spin (off when the node is oversubscribed) and, with
    ``bind="cores"``, this process's affinity: node rank r takes cores [r*n, (r+1)*n) of the
    node's mask, before any kernel thread exists, so they inherit it."""
    from mpi4py import MPI

    mpi = _mpi_comm(comm)
    if bind not in ("none", "cores"):
        raise ValueError(f"bind={bind!r}: expected 'cores' or 'none'")
    node = mpi.Split_type(MPI.COMM_TYPE_SHARED, key=mpi.Get_rank())
    try:
        mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        masks = node.allgather(mine)
        union = sorted(set().union(*masks))
        cores, ranks = len(union), node.Get_size()
        if threads:
            n, why = threads, f"{threads_from or 'asked'}; {cores} cores / {ranks} ranks on this node"
        else:
            n = max(1, cores // ranks)
            why = f"{cores} cores / {ranks} ranks on this node"
            if n > kernels.max_threads():            # said, not silently capped
                n, why = kernels.max_threads(), why + f", capped at the kernel pool's {kernels.max_threads()} threads"
        if n * ranks > cores:
            kernels.set_spin_us(0)
            why += ", oversubscribed: no spinning"
        if bind == "cores":
            why += "; " + _bind(node, masks, union, n)
    finally:
        node.Free()
    return n, why


def share_cores(comm, threads: int = 0, threads_from: str = "", bind: str = "none") -> tuple:
    """node_share, then this process's kernel and BLAS threads set to it. -> (n, why)."""
    n, why = node_share(comm, threads, threads_from, bind)
    kernels.set_process_threads(n)
    return n, why


def _bind(node, masks, union, n) -> str:
    """Node rank r takes cores union[r*n:(r+1)*n]. Collective over the node. -> what was done."""
    ranks = node.Get_size()
    if any(m != masks[0] for m in masks):
        return "not bound: the node's ranks have different affinity masks (the launcher placed them)"
    if n * ranks > len(union):
        return f"not bound: {ranks} ranks x {n} threads exceed the {len(union)} cores of the mask"
    r = node.Get_rank()
    os.sched_setaffinity(0, union[r * n:(r + 1) * n])
    got = node.allgather(sorted(os.sched_getaffinity(0)))
    return "bound, node rank:cores " + " ".join(f"{i}:{','.join(map(str, c))}" for i, c in enumerate(got))
