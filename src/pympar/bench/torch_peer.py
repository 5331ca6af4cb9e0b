"""torch.distributed gloo allreduce as an outside peer of the benchmark (optional).

PyTorch is never a dependency of pympar: this module is imported only by the benchmark,
only when torch imports, and only to time gloo next to pympar's algorithms.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np


def available() -> bool:
    try:
        import torch.distributed as dist  # noqa: F401
        return dist.is_available()
    except Exception:
        return False


class GlooAllreduce:
    """One gloo process group over the MPI ranks, bootstrapped through a file store."""

    def __init__(self, mpi_comm):
        import torch.distributed as dist

        self.dist = dist
        path = None
        if mpi_comm.Get_rank() == 0:
            fd, path = tempfile.mkstemp(prefix="pympar_gloo_")
            os.close(fd)
            os.unlink(path)
        path = mpi_comm.bcast(path, 0)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=mpi_comm.Get_rank(),
                                world_size=mpi_comm.Get_size())

    def tensor(self, x):
        import torch

        if x.dtype.name == "bfloat16":
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)

    def allreduce(self, t, op):
        ops = {"sum": self.dist.ReduceOp.SUM, "max": self.dist.ReduceOp.MAX, "min": self.dist.ReduceOp.MIN,
               "avg": self.dist.ReduceOp.SUM}
        self.dist.all_reduce(t, op=ops[op])

    def close(self):
        self.dist.destroy_process_group()
