"""``python tests/faulty_train.py ARGS`` = ``python -m pympar.train ARGS`` with faults injected,
for the tests of failures, restarts and watchdogs (tests/test_failures.py, tests/test_launch.py).
The package constructs no injector; this entry point passes one to ``pympar.train.main``.

The faults, from the environment:
    PYMPAR_INJECT_NAN_STEP=3[,4,...]   steps whose gradient gets a NaN
    PYMPAR_INJECT_NAN_RANK=0           on this rank (default 0; -1 = every rank)
    PYMPAR_INJECT_NAN_PARAM=NAME       in this parameter (default: the first one backward finishes)
    PYMPAR_INJECT_KILL_STEP=k, PYMPAR_INJECT_KILL_RANK=r   rank r SIGKILLs itself at step k
    PYMPAR_INJECT_HOSTS_FILE=F, PYMPAR_INJECT_HOSTS_TEXT=T  ... having first written T to F (a hostfile)
    PYMPAR_INJECT_HANG_STEP=k, PYMPAR_INJECT_HANG_RANK=r   rank r sleeps (outside MPI) from step k
    PYMPAR_INJECT_FREEZE_STEP=k, PYMPAR_INJECT_FREEZE_RANK=r  rank r SIGSTOPs itself at step k (heartbeat too)
    PYMPAR_INJECT_FILL_STEP=k, PYMPAR_INJECT_FILL_PATH=F   at step k rank 0 writes F until the disk is full
    PYMPAR_INJECT_FSIZE_STEP=k        at step k every rank limits the files it writes to what they hold
                                      (RLIMIT_FSIZE: a write beyond fails with EFBIG, as on a full disk)
They fire in the first attempt of a ``pympar.launch`` job only (PYMPAR_LAUNCH_ATTEMPT, which the
supervisor sets, 0 or unset); a variable with the suffix ``_<k>`` (PYMPAR_INJECT_KILL_STEP_2=26)
fires in attempt k instead, so one job can meet a fault per attempt.
``python -m pympar.launch --program tests/faulty_train.py`` runs it.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np


ATTEMPT = int(os.environ.get("PYMPAR_LAUNCH_ATTEMPT") or 0)


def _env(name, default=""):
    """NAME_<attempt>, else NAME in the first attempt only."""
    v = os.environ.get(f"{name}_{ATTEMPT}")
    if v is None:
        v = os.environ.get(name, default) if ATTEMPT == 0 else default
    return v


def _env_steps(name):
    return {int(s) for s in str(_env(name)).split(",") if s.strip()}


def _env_rank(name, default=0):
    return int(_env(name, default))


class FaultInjector:
    """The PYMPAR_INJECT_* faults of this rank (see the module docstring); inert when unset.
    ``pympar.train.main`` calls it as ``faults(rank, model)`` once the model is built, then
    ``begin_step(step)`` before every step."""

    def __init__(self, rank, model):
        self.rank, self.step = rank, -1
        self.nan_steps = _env_steps("PYMPAR_INJECT_NAN_STEP")
        nan_rank = _env_rank("PYMPAR_INJECT_NAN_RANK")
        self.nan_here = bool(self.nan_steps) and nan_rank in (-1, rank)
        self.nan_param = _env("PYMPAR_INJECT_NAN_PARAM") or None
        self.kill = _env_steps("PYMPAR_INJECT_KILL_STEP") if _env_rank("PYMPAR_INJECT_KILL_RANK") == rank else set()
        self.hang = _env_steps("PYMPAR_INJECT_HANG_STEP") if _env_rank("PYMPAR_INJECT_HANG_RANK") == rank else set()
        self.freeze = _env_steps("PYMPAR_INJECT_FREEZE_STEP") if _env_rank("PYMPAR_INJECT_FREEZE_RANK") == rank \
            else set()
        self.fill = _env_steps("PYMPAR_INJECT_FILL_STEP") if rank == 0 else set()
        self.fill_path = _env("PYMPAR_INJECT_FILL_PATH")
        self.fsize = _env_steps("PYMPAR_INJECT_FSIZE_STEP")
        if self.nan_here:
            self._names = {id(p): n for n, p in model.named_parameters()}
            if self.nan_param is not None and self.nan_param not in self._names.values():
                raise ValueError(f"PYMPAR_INJECT_NAN_PARAM={self.nan_param}: no such parameter")
            model.grad_ready_hooks.insert(0, self._poison)   # before the DP sync copies the grads

    def begin_step(self, step):
        self.step = step
        if step in self.kill:
            hosts = _env("PYMPAR_INJECT_HOSTS_FILE")
            if hosts:                         # the cluster manager's new hostfile, as the node dies
                Path(hosts).write_text(_env("PYMPAR_INJECT_HOSTS_TEXT").replace("\\n", "\n"))
            os.kill(os.getpid(), signal.SIGKILL)
        if step in self.hang:
            while True:
                time.sleep(3600)
        if step in self.freeze:               # the whole process stops, its heartbeat thread too
            os.kill(os.getpid(), signal.SIGSTOP)
        if step in self.fill:                 # another user's file takes the disk's last byte
            with open(self.fill_path, "wb", buffering=0) as f:
                for chunk in (1 << 16, 1 << 12, 1):
                    try:
                        while True:
                            f.write(b"\0" * chunk)
                    except OSError:
                        pass
        if step in self.fsize:
            import resource
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def _poison(self, params, partial=False):
        if partial or self.step not in self.nan_steps:
            return
        for p in params:
            if self.nan_param is None or self._names.get(id(p)) == self.nan_param:
                p.grad.reshape(-1)[0] = np.nan
                return


if __name__ == "__main__":
    from pympar import train

    sys.exit(train.main(sys.argv[1:], faults=FaultInjector))
