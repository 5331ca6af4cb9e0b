"""--async-save: the checkpoint's arrays are copied at the end of the step and written by a thread
while training goes on; it is published once every rank's file is written (agreed on the step's
allreduce), the next save waits for the previous one, and a crash mid-write leaves the previous
checkpoint the latest.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpirun import mpi_env, mpiexec, run_mpi

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["-m", "pympar.train", "--preset", "tiny", "--n-layer", "2", "--steps", "12", "--save-every", "4",
        "--eval-every", "0", "--eval-iters", "1", "--sample-tokens", "0", "--progress", "log"]


def _tensors(ck):
    from pympar.checkpoint import Checkpoint

    c = Checkpoint(ck)
    return {k: c.read(k) for k in c.tensors}


def test_async_checkpoints_equal_the_synchronous_ones_and_resume(tmp_path):
    """The state written in the background is the state at the save's step (the arrays were copied
    before training changed them): every tensor of every checkpoint equals the synchronous run's,
    and a run resumed from one continues bitwise."""
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    run_mpi(2, [*ARGS, "--out", str(sync)], timeout=120)
    run_mpi(2, [*ARGS, "--out", str(asyn), "--async-save"], timeout=120)
    for step in (4, 8, 12):
        a, b = _tensors(sync / "checkpoints" / f"step_{step:08d}"), _tensors(asyn / "checkpoints" / f"step_{step:08d}")
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), step
    assert (asyn / "checkpoints" / "latest").read_text().strip().endswith("step_00000012")
    res = run_mpi(2, [*ARGS, "--out", str(tmp_path / "resumed"), "--resume", str(asyn / "checkpoints" / "step_00000008"),
                      "--async-save"], timeout=120)
    assert "resumed from" in res.stdout
    import json

    def losses(d):
        return {r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}
    ref, got = losses(sync), losses(tmp_path / "resumed")
    assert sorted(got) == [8, 9, 10, 11] and all(got[s] == ref[s] for s in got)


DRIVER = r'''
import sys, threading, time
from pympar.checkpoint import saving
real = saving._write_shard_file
def slow(path, tensors, metadata):
    if "step_00000008" in str(path) and threading.current_thread() is not threading.main_thread():
        print("BLOCKED in the background write", flush=True)
        time.sleep(600)
    return real(path, tensors, metadata)
saving._write_shard_file = slow
from pympar.train import main
sys.exit(main(sys.argv[1:]))
'''


def test_killed_during_the_background_write_the_previous_checkpoint_is_the_latest(tmp_path):
    out, driver = tmp_path / "run", tmp_path / "driver.py"
    driver.write_text(DRIVER)
    cmd = [mpiexec(), "-n", "2", sys.executable, str(driver), *ARGS[2:], "--steps", "40", "--out", str(out),
           "--async-save"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(),
                         cwd=ROOT / "tests", start_new_session=True)
    try:
        seen, t0 = "", time.monotonic()
        while "BLOCKED" not in seen:
            line = p.stdout.readline()
            assert line or p.poll() is None, seen[-3000:]
            seen += line
            assert time.monotonic() - t0 < 120, seen[-3000:]
        time.sleep(0.5)                       # training goes on meanwhile; then the job dies
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    ck = out / "checkpoints"
    assert (ck / "latest").read_text().strip().endswith("step_00000004"), sorted(ck.iterdir())
    assert not (ck / "step_00000008").exists()
    res = run_mpi(2, [*ARGS, "--steps", "40", "--out", str(out), "--resume", "auto"], timeout=180)
    assert f"resumed from {ck / 'step_00000004'}" in res.stdout, res.stdout[-2000:]
