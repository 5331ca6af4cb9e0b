"""A training run's numbers never depend on which collective algorithm a measurement found fastest.

``python -m pympar.train`` runs with $PYMPAR_TUNING=reproducible unless the variable is set: a
floating-point reduction over 3 or more ranks takes the library's call (another algorithm adds the
ranks in another order, and a measured choice can differ between two jobs), while data movement
and integer reductions are still measured. The driver below makes auto's measurement say that one
chosen pympar algorithm is 10x faster than every other candidate -- what a slow or noisy minute can
make any of them look like -- and prints, at the end, every decision auto took.
"""
import json

import numpy as np
import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.mpi

ARGS = ["--preset", "tiny", "--n-layer", "2", "--steps", "6", "--eval-every", "0", "--eval-iters", "1",
        "--sample-tokens", "0", "--progress", "log", "--save-every", "6"]

DRIVER = r'''
import json, os, sys
from mpi4py import MPI
from pympar.comm import tuning
FAST = os.environ["FAKE_FASTEST"]

def measure(names, runs, coll, nbytes, timer=None, waiter=None):
    for name in names:                       # the candidates still run (on the call's operands)
        runs[name]()
    return {n: (1e-4 if n == FAST else 1e-3) for n in names}

tuning.measure = measure
import pympar.comm.mpi as cm
cm.measure = measure
from pympar.train import main
rc = main(sys.argv[1:])
if MPI.COMM_WORLD.Get_rank() == 0:
    seen = [d.as_dict() for ds in tuning._SHARED.values() for d in ds.values()]
    print("DECISIONS " + json.dumps(seen), flush=True)
sys.exit(rc)
'''


def _run(tmp_path, name, fastest, extra=(), env=None):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = tmp_path / name
    res = run_mpi(3, [str(driver), *ARGS, *extra, "--out", str(out)], timeout=150,
                  env={"FAKE_FASTEST": fastest, **(env or {})})
    line = [x for x in res.stdout.splitlines() if x.startswith("DECISIONS ")]
    assert line, res.stdout[-3000:]
    from pympar.checkpoint import Checkpoint

    ck = Checkpoint(out / "checkpoints" / "step_00000006")
    return json.loads(line[-1][len("DECISIONS "):]), {k: ck.read(k) for k in ck.tensors}


def _float_reductions(decisions):
    return [d for d in decisions if d["collective"] in ("allreduce", "reduce_scatter", "reduce")
            and np.dtype(d["dtype"]).kind == "f"]


@pytest.mark.parametrize("extra", [(), ("--zero", "1")], ids=["dp3", "dp3-zero1"])
def test_training_takes_no_measured_choice_for_a_floating_point_reduction(tmp_path, extra):
    # the control: told to measure, auto takes the faked winner for the float reductions
    measured, _ = _run(tmp_path, "measure", "ring", extra, env={"PYMPAR_TUNING": "measure"})
    assert _float_reductions(measured), measured
    assert all(d["source"] == "measured" and d["algo"] == "ring" for d in _float_reductions(measured)), measured
    # the trainer's default: the same faked timings change nothing a float reduction runs
    runs = {fast: _run(tmp_path, fast, fast, extra) for fast in ("ring", "recursive_doubling")}
    for fast, (decisions, _) in runs.items():
        red = _float_reductions(decisions)
        assert red and all(d["source"] == "reproducible" and d["algo"] == "blocking" for d in red), decisions
        rest = [d for d in decisions if d not in red]
        assert all(d["source"] in ("measured", "only") for d in rest), rest
    (_, a), (_, b) = runs.values()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
