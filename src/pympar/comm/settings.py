"""The communication library's settings: explicit values, set by ``configure``.

Nothing in pympar.comm reads the environment. The applications (``python -m pympar.train``,
``python -m pympar.bench``, ...) read it once, in ``pympar.config.apply_environment``, and call
``configure`` with what they found (the table of variables is there and in docs/comm.md). A
program that uses the communicators directly passes values to the constructors
(``MPIComm(comm, timeout=...)``) or calls ``configure`` itself; with neither, the defaults below
hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass
class Settings:
    timeout: float = 300.0              # seconds a stalled call waits before CommTimeoutError (inf: never)
    debug_collectives: bool = False     # every collective's fingerprint checked across the ranks
    tuning: str = ""                    # "" / "measure": measure the algorithms; "library"; or a tuning file
    shm_chunk: int = 1 << 19            # bytes per chunk of the shared-memory reductions
    cuda_aware_mpi: bool | None = None  # does MPI read device memory? None: ask the library
    ranks_per_node: int | None = None   # ranks per node the topology assumes; None: MPI's shared-memory split


SETTINGS = Settings()


def configure(**values) -> Settings:
    """Set some of the settings (keyword: a field of Settings); ValueError on a bad value."""
    known = {f.name for f in fields(Settings)}
    bad = sorted(set(values) - known)
    if bad:
        raise TypeError(f"configure: unknown settings {bad}; expected some of {sorted(known)}")
    if "timeout" in values:
        t = float(values["timeout"])
        if math.isnan(t):
            raise ValueError(f"timeout={values['timeout']!r} must be a number of seconds")
        values["timeout"] = math.inf if t <= 0 else t
    if "shm_chunk" in values and int(values["shm_chunk"]) < 64:
        raise ValueError(f"shm_chunk={values['shm_chunk']} must be at least 64 bytes")
    if values.get("ranks_per_node") is not None and int(values["ranks_per_node"]) < 1:
        raise ValueError(f"ranks_per_node={values['ranks_per_node']} must be a positive integer")
    for k, v in values.items():
        setattr(SETTINGS, k, v)
    return SETTINGS
