"""Failures of a training run under mpiexec: a killed rank ends the job within a bound and
--resume auto continues bitwise; a hung rank is named by the watchdog and the job aborts;
non-finite gradients are skipped (float16: the loss scale drops) or stop the run naming the
parameter; nothing non-finite reaches a checkpoint. Faults come from PYMPAR_INJECT_* (tests/faulty_train.py)."""
import json
import time
from pathlib import Path

import numpy as np

from mpirun import run_mpi

FAULTY = str(Path(__file__).resolve().parent / "faulty_train.py")   # pympar.train + PYMPAR_INJECT_* faults

SMALL = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--micro-batch-size", "2",
         "--eval-iters", "1", "--sample-tokens", "0", "--progress", "log", "--eval-every", "0"]


def train(n, text, out, *args, env=None, check=True, timeout=90):
    t0 = time.monotonic()
    p = run_mpi(n, [FAULTY, "--data", text, *SMALL, "--out", out, *map(str, args)],
                timeout=timeout, env=env, check=check)
    return p, time.monotonic() - t0


def metrics(out):
    return [json.loads(ln) for ln in open(f"{out}/metrics.jsonl")]


def test_killed_rank_ends_the_job_and_resume_auto_is_bitwise(text, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(2, text, a, "--steps", 8)
    # rank 1 is SIGKILLed at the start of step 5 (after the checkpoint of step 3 and step 4's update)
    p, dt = train(2, text, b, "--steps", 8, "--save-every", 3, "--comm-timeout", 5, check=False,
                  env={"PYMPAR_INJECT_KILL_STEP": 5, "PYMPAR_INJECT_KILL_RANK": 1})
    assert p.returncode != 0, p.stdout
    assert dt < 5 + 20, f"the job took {dt:.1f}s to end after a rank died"
    assert ("KILLED BY SIGNAL: 9" in p.stdout or "Killed (signal 9)" in p.stdout
            or "collective watchdog" in p.stdout), p.stdout[-3000:]
    p, _ = train(2, text, b, "--steps", 8, "--save-every", 3, "--resume", "auto")
    assert "resumed from" in p.stdout and "step_00000003 at step 3" in p.stdout, p.stdout
    la, lb = [r["loss"] for r in metrics(a)], [r["loss"] for r in metrics(b)]
    assert [r["step"] for r in metrics(b)] == list(range(8))
    assert la == lb, (la, lb)          # bitwise: float32 on the CPU, same layout


def test_hung_rank_is_named_by_the_watchdog_and_the_job_aborts(text, tmp_path):
    p, dt = train(3, text, str(tmp_path / "h"), "--steps", 6, "--comm-timeout", 2, check=False,
                  env={"PYMPAR_INJECT_HANG_STEP": 2, "PYMPAR_INJECT_HANG_RANK": 1})
    assert p.returncode != 0, p.stdout
    assert dt < 2 + 20, dt
    assert "collective watchdog" in p.stdout and "no answer from rank(s) 1 " in p.stdout, p.stdout[-3000:]
    assert "aborting the job" in p.stdout


def test_nonfinite_grads_stop_the_run_naming_the_parameter(text, tmp_path):
    out = str(tmp_path / "n")
    name = "transformer.h.1.mlp.c_fc.weight"
    p, _ = train(2, text, out, "--steps", 8, "--save-every", 1, "--max-bad-steps", 3, check=False,
                 env={"PYMPAR_INJECT_NAN_STEP": "2,3,4,5", "PYMPAR_INJECT_NAN_RANK": 1, "PYMPAR_INJECT_NAN_PARAM": name})
    assert p.returncode == 4, p.stdout
    errs = [ln for ln in p.stdout.splitlines() if ln.startswith("pympar.train: error:")]
    assert len(errs) == 2 and len({e.split(": ", 3)[-1] for e in errs}) == 1, errs   # every rank, one message
    assert "3 consecutive steps" in errs[0] and f"at step 2 was in parameter {name}" in errs[0], errs
    m = metrics(out)
    assert [r["step"] for r in m] == [0, 1, 2, 3, 4]
    assert [r["skipped"] for r in m] == [False, False, True, True, True]
    # the weights never moved after step 1, and every checkpoint holds finite numbers
    from pympar.checkpoint import Checkpoint, load
    ck = Checkpoint(f"{out}/checkpoints")
    assert ck.step == 4, ck.step       # saved after steps 2 and 3 were skipped; step 4 stopped the run
    want = {k: (tuple(v["full_shape"]), ()) for k, v in ck.tensors.items()}
    after4, _ = load(ck.path, want)
    after2, _ = load(f"{out}/checkpoints/step_00000002", want)
    assert all(np.isfinite(a).all() for a in after4.values())
    assert all(np.array_equal(after4[k], after2[k]) for k in want), "a skipped step changed the weights or optimiser"

def test_float16_skips_and_lowers_the_loss_scale(text, tmp_path):
    out = str(tmp_path / "f")
    train(2, text, out, "--steps", 6, "--dtype", "float16", env={"PYMPAR_INJECT_NAN_STEP": "2,3"})
    m = metrics(out)
    assert [r["skipped"] for r in m] == [False, False, True, True, False, False]
    scales = [r["loss_scale"] for r in m]
    assert scales[3] == scales[2] / 2 and scales[4] == scales[2] / 4, scales
    assert all(np.isfinite(r["loss"]) for r in m)
