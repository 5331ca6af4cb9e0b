"""Stop on request: SIGTERM, SIGINT or SIGUSR1 to the ranks of a running ``python -m pympar.train``.

Real processes and real signals: the job is started under mpiexec, the test waits until it has
logged a few steps, then signals the rank processes themselves (every rank, as srun does, or one
rank only). Every rank must stop at the same step, write a checkpoint (with --out), rank 0 must say
where and how to resume, and the job must exit with status 75 (faults.RESUMABLE_STATUS); a run
resumed with --resume auto must then log the uninterrupted run's losses bitwise.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import mpi_env, mpiexec, run_mpi
from pympar.resilience import RESUMABLE_STATUS

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
STEPS = 300
ARGS = ["-m", "pympar.train", "--preset", "tiny", "--n-layer", "2", "--steps", str(STEPS), "--eval-every", "0",
        "--eval-iters", "1", "--sample-tokens", "0", "--progress", "log", "--log-every", "50"]


def _ranks_of(out: Path):
    """pids of the rank processes of the job writing to ``out`` (their command lines name it)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pympar.train" in cmd and str(out).encode() in cmd and not any(b"mpiexec" in c for c in cmd[:1]):
            pids.append(int(d.name))
    return pids


def _steps_logged(out: Path):
    f = out / "metrics.jsonl"
    if not f.is_file():
        return []
    rows = []
    for line in f.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def _signalled_run(n, out, sig, which="all", extra=(), twice=False, timeout=120):
    """Start the job, wait for 3 logged steps, send ``sig`` to every rank (or rank pid 0 only);
    -> (exit status, output)."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, *ARGS, "--out", str(out), *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(),
                         cwd=ROOT / "tests", start_new_session=True)
    try:
        t0 = time.monotonic()
        while len(_steps_logged(out)) < 3:
            assert p.poll() is None, f"the job ended before it was signalled:\n{p.communicate()[0][-3000:]}"
            assert time.monotonic() - t0 < timeout, "no steps logged"
            time.sleep(0.05)
        pids = sorted(_ranks_of(out))
        assert len(pids) == n, (pids, n)
        targets = pids if which == "all" else pids[-1:]
        for pid in targets:
            os.kill(pid, sig)
        if twice:                                # again, once the checkpoint is published: the ranks are then
            ck = out / "checkpoints"                 # between their save and their exit, where a default
            while p.poll() is None and not (ck / "latest").exists():   # handler back in place would kill
                assert time.monotonic() - t0 < timeout, "no checkpoint after the signal"   # them (status 15)
                time.sleep(0.01)
            for pid in targets:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        text, _ = p.communicate(timeout=timeout)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return p.returncode, text


def _reference(n, tmp_path):
    ref = tmp_path / "ref"
    run_mpi(n, [*ARGS, "--out", str(ref)], timeout=180)
    return {r["step"]: r for r in _steps_logged(ref)}


@pytest.mark.parametrize("sig, which, twice", [
    (signal.SIGTERM, "all", False),             # a scheduler's preemption: every rank
    (signal.SIGUSR1, "one", False),             # Slurm's --signal=USR1@120 reaching one rank
    (signal.SIGTERM, "all", True),              # and again during the save
], ids=["sigterm-every-rank", "sigusr1-one-rank", "sigterm-twice"])
def test_signal_stops_saves_and_the_resumed_run_is_the_uninterrupted_one(tmp_path, sig, which, twice):
    n, out = 2, tmp_path / "run"
    status, text = _signalled_run(n, out, sig, which, twice=twice)
    assert status == RESUMABLE_STATUS, text[-3000:]
    lines = [x for x in text.splitlines() if "stopped on request" in x]
    assert len(lines) == 1 and "resume with the same command and --resume auto" in lines[0], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    logged = _steps_logged(out)
    stopped_after = logged[-1]["step"] + 1
    assert 3 <= stopped_after < STEPS
    ckpt = out / "checkpoints" / f"step_{stopped_after:08d}"
    assert ckpt.is_dir() and f"saved {ckpt}" in lines[0], (lines, sorted((out / "checkpoints").iterdir()))
    res = run_mpi(n, [*ARGS, "--out", str(out), "--resume", "auto"], timeout=180)
    assert f"resumed from {ckpt}" in res.stdout, res.stdout[-2000:]
    ref = _reference(n, tmp_path)
    got = {r["step"]: r for r in _steps_logged(out)}
    assert sorted(got) == sorted(ref) == list(range(STEPS))
    for s in range(STEPS):
        assert got[s]["loss"] == ref[s]["loss"] and got[s]["grad_norm"] == ref[s]["grad_norm"], s


def test_signal_without_out_says_nothing_could_be_saved(tmp_path):
    """No --out: nothing to save into, said once, status 75 all the same. (The test finds the ranks
    by the data path they were given.)"""
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("the quick brown fox jumps over the lazy dog. " * 4000)
    cmd = [mpiexec(), "-n", "2", sys.executable, *ARGS, "--data", str(text_file), "--steps", "100000"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(),
                         cwd=ROOT / "tests", start_new_session=True)
    try:
        # rank 0 logs step 0 after the step's world allreduce, which every rank enters after installing
        # its handlers: the line is the event that they are in place
        head = []
        for line in p.stdout:
            head.append(line)
            if line.startswith("step "):
                break
        assert p.poll() is None and head and head[-1].startswith("step "), "".join(head)[-3000:]
        pids = _ranks_of(text_file)
        assert len(pids) == 2, pids
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        rest, _ = p.communicate(timeout=120)
        text = "".join(head) + rest
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    assert p.returncode == RESUMABLE_STATUS, text[-3000:]
    assert text.count("nothing could be saved (no --out)") == 1 and "Traceback" not in text, text[-3000:]
