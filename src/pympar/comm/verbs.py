"""The collective verbs, one description each: the algorithms a verb runs, what it does with its
operand, and its bus factor. MPIComm (pympar.comm.mpi) checks and chooses algorithms from it,
pympar.bench reports bus bandwidth with it; no MPI here.

  algorithms      pympar's own algorithms and the library's call ("mpi"); "auto" chooses among
                  those the topology allows (MPIComm.candidates), "blocking" is the library's
                  blocking call on a communicator made with on_timeout="abort"
  nonblocking     the algorithms of the verb's nonblocking form (i<verb>): the library's
                  nonblocking collective, and for some pympar's ring run as a state machine
  reducing        takes a reduction op (sum, avg, max, min)
  in_place        the result can land in the operand itself
  bus_factor(n)   nccl-tests' bus bandwidth: busbw = algbw x bus_factor(n) on n ranks, the
                  fraction of the data each rank's link carries in the ideal algorithm, so that
                  busbw is comparable across verbs and sizes against the link's speed
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Verb:
    name: str
    algorithms: tuple
    bus_factor: Callable[[int], float]
    nonblocking: tuple = ("mpi",)
    reducing: bool = False
    in_place: bool = False


def _share(n: int) -> float:           # each rank sends (n-1)/n of the buffer
    return (n - 1) / n


VERBS = {v.name: v for v in (
    Verb("allreduce", ("ring", "recursive_doubling", "rabenseifner", "shm", "hierarchical", "mpi"),
         lambda n: 2 * (n - 1) / n, nonblocking=("mpi", "ring"), reducing=True, in_place=True),
    Verb("reduce_scatter", ("ring", "recursive_halving", "shm", "hierarchical", "mpi"), _share,
         nonblocking=("mpi", "ring"), reducing=True),
    Verb("allgather", ("ring", "recursive_doubling", "shm", "hierarchical", "mpi"), _share,
         nonblocking=("mpi", "ring")),
    Verb("broadcast", ("binomial", "scatter_allgather", "shm", "mpi"), lambda n: 1.0, in_place=True),
    Verb("alltoall", ("pairwise", "mpi"), _share),
    Verb("alltoallv", ("mpi",), _share),
)}

# {verb: its algorithms} of the verbs that take algo= (alltoallv has the library's call only)
ALGOS = {name: v.algorithms for name, v in VERBS.items() if name != "alltoallv"}
