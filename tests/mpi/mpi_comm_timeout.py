"""Run under mpiexec (a script, not pytest): rank 1 skips a collective, the others must raise
CommTimeoutError naming the operation, the communicator, its sequence number and rank 1."""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from pympar.comm import CommTimeoutError, MPIComm

algo = sys.argv[1]
world = MPI.COMM_WORLD
c = MPIComm(world, name="watched", timeout=1.5)
c.allreduce(np.ones(4), algo=algo)   # seq 1 completes everywhere
t0 = time.monotonic()
if c.rank != 1:
    try:
        c.allreduce(np.ones(4), algo=algo)
        print(f"rank {c.rank}: NO-ERROR", flush=True)
    except CommTimeoutError as e:
        dt = time.monotonic() - t0
        print(f"rank {c.rank}: TIMEOUT op={e.op} comm={e.comm_name} seq={e.seq} peers={e.pending_peers} "
              f"after={dt:.1f}s msg={e}", flush=True)
world.Barrier()
sys.stdout.flush()
os._exit(0)   # leave without MPI_Finalize: the abandoned collective may still be pending
