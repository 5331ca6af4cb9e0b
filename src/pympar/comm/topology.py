"""Which ranks share a node: MPI's shared-memory split, or PYMPAR_RANKS_PER_NODE to simulate.

With PYMPAR_RANKS_PER_NODE=k, world ranks [0,k), [k,2k), ... count as separate nodes
(intersected with the real shared-memory split), so one machine can exercise the
hierarchical algorithms and the topology-aware mesh.
"""
from __future__ import annotations


from mpi4py import MPI

from . import progress
from .settings import SETTINGS



def node_split(comm):
    """The node communicator of ``comm`` (mpi4py), ranks ordered as in comm."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    k = SETTINGS.ranks_per_node              # imposed by the settings (pympar.comm.settings), or None
    if k is not None:
        sim = node.Split(MPI.COMM_WORLD.Get_rank() // k, key=comm.Get_rank())
        node.Free()
        node = sim
    return node


class Topology:
    """Node structure of one communicator (built collectively, once)."""

    def __init__(self, comm):
        self.node = node_split(comm)
        self.node_rank, self.node_size = self.node.Get_rank(), self.node.Get_size()
        # ranks of comm on this host whatever the transport (MPIR_CVAR_NOLOCAL makes every rank its own
        # shared-memory "node", yet they still share the host's cores): the polling pace counts these
        # and the cores they may use together (the union of their affinity masks)
        info = comm.allgather((MPI.Get_processor_name(), progress.affinity()))
        host = info[comm.Get_rank()][0]
        self.host_size = sum(1 for name, _ in info if name == host)
        self.host_cores = len(set().union(*(set(cores) for name, cores in info if name == host)))
        progress.note_local_ranks(max(self.node_size, self.host_size, progress.job_local_ranks()),  # polling pace
                                  self.host_cores)
        is_leader = self.node_rank == 0
        self.leaders = comm.Split(0 if is_leader else MPI.UNDEFINED, key=comm.Get_rank())
        if self.leaders == MPI.COMM_NULL:
            self.leaders = None
        self.n_nodes = comm.allreduce(1 if is_leader else 0)
        self.max_node_size = comm.allreduce(self.node_size, op=MPI.MAX)
        self.uniform = comm.allreduce(self.node_size, op=MPI.MIN) == self.max_node_size
        grp = comm.Get_group()
        self.node_to_comm = self.node.Get_group().Translate_ranks(list(range(self.node_size)), grp)
        # node index (in the order of the leaders' communicator) of every rank of comm, and the
        # ranks of each node in node order: what the hierarchical reduce-scatter/allgather need
        leader_of = comm.allgather(self.node_to_comm[0])
        order = sorted(set(leader_of))
        self.node_of = [order.index(l) for l in leader_of]
        self.node_members = [[k for k, j in enumerate(self.node_of) if j == i] for i in range(len(order))]
        self.leader_comm_ranks = None
        grp.Free()

    def free(self):
        """Release the node and leaders communicators (collective over the communicator's ranks)."""
        for c in (self.node, self.leaders):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
        self.node = self.leaders = None

    @property
    def single_node(self) -> bool:
        return self.n_nodes == 1
