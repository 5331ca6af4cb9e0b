"""Inside every rank: save_run agrees on non-finite parameters before its collectives.

The ranks hold different parameters (pipeline stages, tensor shards); only the last rank's
are poisoned here. Every rank must stop with NonFiniteStop at once: before the agreement
the clean ranks went on into the checkpoint's collectives and waited there for the others."""
import types

import numpy as np
import pytest

from pympar.comm import MPIComm
from pympar.resilience import BadStepGuard, NonFiniteStop, save_run


class _Param:
    def __init__(self, data):
        self.data = data


def test_save_run_stops_every_rank_when_one_holds_a_non_finite_parameter(mpi_world, tmp_path_factory):
    comm = MPIComm(mpi_world, name="save", timeout=20)
    w = np.ones(3, np.float32)
    if comm.rank == comm.size - 1:
        w[1] = np.nan
    model = types.SimpleNamespace(named_parameters=lambda: [(f"stage{comm.rank}.w", _Param(w))])
    runner = types.SimpleNamespace(model=model, opt=None)
    run = types.SimpleNamespace(seed=0, out=str(tmp_path_factory.mktemp("out")), keep=0)
    with pytest.raises(NonFiniteStop) as e:
        save_run(runner, run, 5, BadStepGuard(0), comm, "dp=1")
    if comm.rank == comm.size - 1:
        assert f"parameter stage{comm.rank}.w holds non-finite values at step 5" in str(e.value)
    else:
        assert "a parameter of 1 other rank(s) holds non-finite values at step 5" in str(e.value)
    comm.barrier()   # every rank is still in step: nobody went on into the save
