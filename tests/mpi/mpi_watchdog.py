"""Run under mpiexec (a script, not pytest): scenarios of the collective watchdog.

    mpi_watchdog.py skip ALGO      rank 1 skips allreduce #2; the others print who did not arrive
    mpi_watchdog.py wrongop ALGO   rank 1 calls a barrier where the others call allreduce #2
    mpi_watchdog.py mismatch       (PYMPAR_DEBUG_COLLECTIVES=1) rank 1 passes another count
    mpi_watchdog.py rootmismatch   (PYMPAR_DEBUG_COLLECTIVES=1) rank 1 broadcasts from another root
    mpi_watchdog.py busy ALGO      rank 1 sleeps outside MPI instead: reported as not answering
    mpi_watchdog.py abort          rank 1 skips; the others call watchdog.abort_job (job ends non-zero)
    mpi_watchdog.py blocking ALGO  (on_timeout="abort") rank 1 skips: a wait blocked inside the library
                                   (algo "blocking"; "mpi" where ranks <= cores) cannot time out, the
                                   deadline thread ends the job; the others say whether they blocked
    mpi_watchdog.py sendrecv       rank 1 never sends; rank 0's recv times out naming rank 1
    mpi_watchdog.py gather         rank 1 skips comm.objects.gather_object: the others time out
    mpi_watchdog.py gatherok       every rank gathers a dict holding an array: rank 0 checks the list
    mpi_watchdog.py exitahead      rank 1 calls one more collective (on comm "slow", timeout 60 s); the
                                   others exit normally: their teardown must end the job naming it
    mpi_watchdog.py exitlate       rank 1 computes outside MPI for 4 s, then every rank exits normally:
                                   the teardown waits for it (status 0)

Each rank prints one line ``rank R: <KIND> ...`` that tests/test_watchdog.py parses.
"""
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from pympar.comm import CommTimeoutError, MPIComm
from pympar.comm.objects import gather_object
from pympar.comm.debug import CollectiveMismatchError
from pympar.comm.watchdog import SLOT, abort_job
from pympar.config import apply_environment

apply_environment()      # a script of its own: PYMPAR_DEBUG_COLLECTIVES, PYMPAR_COMM_TIMEOUT as the test set them

scenario = sys.argv[1]
algo = sys.argv[2] if len(sys.argv) > 2 else "auto"
world = MPI.COMM_WORLD
c = MPIComm(world, name="watched", timeout=float(os.environ.get("WATCHDOG_TIMEOUT", "1.5")),
            on_timeout="abort" if scenario == "blocking" else "raise")
c.allreduce(np.ones(4), algo=algo)   # seq 1 completes everywhere
t0 = time.monotonic()


def line(kind, e=None):
    extra = ""
    if isinstance(e, CommTimeoutError):
        extra = f" op={e.op} comm={e.comm_name} seq={e.seq} peers={e.pending_peers} "
    msg = f"rank {c.rank}: {kind}{extra} after={time.monotonic() - t0:.1f}s msg={e}\n"
    os.write(1, msg.encode())     # one write per line: the ranks' lines must not interleave
    if os.environ.get("WATCHDOG_OUT"):   # the test reads the reports here: a file is written when
        with open(os.path.join(os.environ["WATCHDOG_OUT"], f"rank_{c.rank}.txt"), "a") as f:
            f.write(msg)                 # this returns, whatever ends the job afterwards


def report_the_wait():
    """Half a second into the stalled call: is the deadline guard's slot armed (the wait blocks
    inside the library) or not (it polls)?"""
    time.sleep(0.5)
    line("ARMED" if SLOT[0] else "POLLED")


try:
    if scenario == "blocking":
        if c.rank != 1:
            threading.Thread(target=report_the_wait, daemon=True).start()
            c.allreduce(np.ones(4), algo=algo)
            line("RETURNED")     # not reached: the deadline thread aborts the job
        else:
            world.Barrier()
    elif scenario in ("skip", "abort"):
        if c.rank != 1:
            c.allreduce(np.ones(4), algo=algo)
        else:
            world.Barrier()      # moved on: waits inside MPI (so it answers the board's reads)
        line("NO-ERROR")
    elif scenario == "busy":     # rank 1 computes outside MPI (cannot answer one-sided reads)
        if c.rank != 1:
            c.allreduce(np.ones(4), algo=algo)
        else:
            time.sleep(float(os.environ.get("WATCHDOG_TIMEOUT", "1.5")) + 5)
        line("NO-ERROR")
    elif scenario == "wrongop":
        if c.rank != 1:
            c.allreduce(np.ones(4), algo=algo)
        else:
            c.barrier()
        line("NO-ERROR")
    elif scenario == "mismatch":
        c.allreduce(np.ones(4 if c.rank != 1 else 5))
        line("NO-ERROR")
    elif scenario == "rootmismatch":
        c.broadcast(np.ones(3), root=0 if c.rank != 1 else 1)
        line("NO-ERROR")
    elif scenario == "gather":   # rank 1 skips gather_object (the timed twin of mpi4py's gather)
        if c.rank != 1:
            got = gather_object(c, {"rank": c.rank}, root=0)
        else:
            world.Barrier()
        line("NO-ERROR")
    elif scenario == "gatherok":
        got = gather_object(c, {"rank": c.rank, "a": np.arange(c.rank + 1)}, root=0)
        want = [{"rank": r, "a": list(range(r + 1))} for r in range(c.size)] if c.rank == 0 else None
        ok = got is None if c.rank else [dict(g, a=g["a"].tolist()) for g in got] == want
        line("GATHERED" if ok else f"WRONG {got}")
    elif scenario in ("exitahead", "exitlate"):   # leave through the atexit teardown (no os._exit)
        slow = MPIComm(world, name="slow", timeout=60)
        slow.allreduce(np.ones(4))
        if c.rank == 1 and scenario == "exitahead":
            slow.allreduce(np.ones(4))   # the others never call it: before the fix they hung in Win_free
        elif c.rank == 1:
            time.sleep(4)                # longer than the 1.5 s timeout of comm "watched"
        line("NO-ERROR")
        sys.exit(0)
    elif scenario == "sendrecv":
        if c.rank == 0:
            c.recv(np.empty(2), 1)
        line("NO-ERROR")
    else:
        raise SystemExit(f"unknown scenario {scenario}")
except (CommTimeoutError, CollectiveMismatchError) as e:
    if scenario == "abort":
        abort_job(e)
    line("TIMEOUT" if isinstance(e, CommTimeoutError) else "MISMATCH", e)
if not (scenario in ("skip", "abort", "gather") and c.rank == 1):   # rank 1 of skip waits there already
    world.Barrier()              # the others' reports are written before rank 1 of skip moves on
sys.stdout.flush()
# The job cannot end with MPI_Finalize: the abandoned collective is still pending on some ranks
# and Finalize could wait for it. Every rank leaving with os._exit races hydra, which kills the
# ranks still running once one leaves without Finalize (seen: exit 9 under load). So once all
# have written their line (the barrier), rank 0 ends the whole job with MPI_Abort(0): mpiexec
# then exits 0 whatever the timing; the others wait to be ended. (An abort may cut the launcher's
# forwarding of what the ranks wrote to stdout: the test reads each rank's report file.)
world.Barrier()
if world.rank == 0:
    world.Abort(0)
while True:
    time.sleep(60)
