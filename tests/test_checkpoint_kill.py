"""A process killed (SIGKILL) in the middle of saving leaves the previous checkpoint loadable
and ``latest`` pointing at it; the next save cleans up and succeeds.

The saving process is a child whose save steps are wrapped (in the child only, by this test) to
stop at a chosen point and announce it; the test then kills it and inspects the directory.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpirun import mpi_env, mpiexec
from pympar.checkpoint import load, save

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import os, sys, time
import numpy as np
from pympar.checkpoint import layout_io, saving

stage, root = sys.argv[1], sys.argv[2]
comm = None
if os.environ.get("CKPT_MPI"):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
rank = comm.rank if comm is not None else 0

def stop(msg):
    print("BLOCKED", msg, flush=True)
    time.sleep(600)

def half_file(path, data):
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush(); os.fsync(f.fileno())

real_write = saving._write_shard_file
def write_shard(path, tensors, metadata):
    digest = real_write(path, tensors, metadata)
    if stage == "shard" and rank == int(os.environ.get("CKPT_STOP_RANK", "0")):
        half_file(path, open(path, "rb").read())   # the file as a crash mid-write leaves it
        stop("shard")
    return digest
saving._write_shard_file = write_shard

real_manifest = saving._write_manifest
def write_manifest(tmp, manifest):
    if stage == "manifest":
        import json
        half_file(tmp / layout_io.MANIFEST, json.dumps(manifest).encode())
        stop("manifest")
    return real_manifest(tmp, manifest)
saving._write_manifest = write_manifest

real_latest = saving._write_latest
def write_latest(root_, final):
    if stage == "published":          # renamed into place, latest not moved yet
        stop("published")
    return real_latest(root_, final)
saving._write_latest = write_latest

real_replace = os.replace
def replace(src, dst):
    if stage == "latest" and os.path.basename(dst) == layout_io.LATEST:
        stop("latest")                # the new pointer written in full under a temporary name
    return real_replace(src, dst)
layout_io.os.replace = replace

real_remove = layout_io.remove_tree
def remove_tree(path):
    if stage == "prune":
        trash = path.with_name(layout_io.TRASH_PREFIX + path.name)
        os.replace(path, trash)
        (trash / layout_io.MANIFEST).unlink()
        stop("prune")
    return real_remove(path)
layout_io.remove_tree = remove_tree

def shards(step):
    a = np.full((4, 6), float(step), np.float32)
    if comm is None or comm.size == 1:
        return {"w": (a, None), "b": (np.arange(3.0) + step, None)}
    from pympar.parallel.shard import Shard
    w = 4 // comm.size
    sh = Shard((4, 6), (slice(comm.rank * w, (comm.rank + 1) * w),))
    return {"w": (sh.take(a), sh), "b": (np.arange(3.0) + step, None)}

if stage == "none":                   # the good checkpoint the killed save must not harm
    saving.save(root, 1, shards(1), {}, meta={"step": 1}, comm=comm)
else:
    saving.save(root, 2, shards(2), {}, meta={"step": 2}, comm=comm, keep=1)
print("DONE", flush=True)
'''


def _child(stage, root, n=0, timeout=60, env=None):
    """Run the child (under mpiexec -n n when n); kill it with SIGKILL once it says BLOCKED."""
    cmd = [sys.executable, "-c", CHILD, stage, str(root)]
    extra = dict(env or {})
    if n:
        cmd = [mpiexec(), "-n", str(n)] + cmd
        extra["CKPT_MPI"] = "1"
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=mpi_env(extra), start_new_session=True)
    deadline = time.time() + timeout
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("BLOCKED") or line.startswith("DONE"):
                break
            if time.time() > deadline:
                break
        done = any(x.startswith("DONE") for x in lines)
        if not done:
            assert any(x.startswith("BLOCKED") for x in lines), "child never reached its stop:\n" + "".join(lines)
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return "".join(lines)


def _assert_previous_whole(root):
    assert (root / "latest").read_text() == "step_00000001\n"
    got, m = load(root, {"w": None, "b": None})
    assert m["step"] == 1
    np.testing.assert_array_equal(got["w"], np.full((4, 6), 1.0, np.float32))


@pytest.mark.parametrize("stage", ["shard", "manifest", "latest"])
def test_kill_mid_save_keeps_previous(tmp_path, stage):
    root = tmp_path / "run"
    assert "DONE" in _child("none", root)
    _child(stage, root)
    _assert_previous_whole(root)
    # a half-written step never appears under its real name
    assert (root / "step_00000002").exists() == (stage == "latest")
    # the next save (another process) cleans the leftovers and works
    save(root, 3, {"w": (np.full((4, 6), 3.0, np.float32), None), "b": (np.zeros(3), None)}, {})
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert load(root, {"w": None})[1]["step"] == 3


def test_kill_after_publish_before_latest(tmp_path):
    root = tmp_path / "run"
    _child("none", root)
    _child("published", root)
    _assert_previous_whole(root)          # latest still names step 1 ...
    got, m = load(root / "step_00000002", {"w": None})   # ... and step 2 is whole too
    np.testing.assert_array_equal(got["w"], np.full((4, 6), 2.0, np.float32))


def test_kill_while_pruning(tmp_path):
    root = tmp_path / "run"
    _child("none", root)
    _child("prune", root)                 # keep=1: deleting step 1 after latest moved to step 2
    assert (root / "latest").read_text() == "step_00000002\n"
    assert load(root, {"w": None})[1]["step"] == 2
    assert not (root / "step_00000001").exists()   # never a half-deleted checkpoint under its name


@pytest.mark.mpi
def test_kill_mpi_job_mid_save(tmp_path):
    """Two ranks: rank 1 dies mid-file while rank 0 waits for it; the job is killed."""
    root = tmp_path / "run"
    assert "DONE" in _child("none", root, n=2)
    _child("shard", root, n=2, env={"CKPT_STOP_RANK": "1"})
    _assert_previous_whole(root)
    assert not (root / "step_00000002").exists()
