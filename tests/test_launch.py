"""``python -m pympar.launch``: the supervisor restarts a failed job on the ranks the hostfile offers
and the training run continues as if nothing happened.

Real jobs under mpiexec; a rank is killed with SIGKILL by the trainer's fault injector
(PYMPAR_INJECT_KILL_STEP, first attempt only). Same world after the restart: every step's loss
and gradient norm bitwise the uninterrupted run's (CPU float32). Elastic 4 -> 2 and 2 -> 4 ranks
through the hostfile, global batch kept by n_micro: within 1e-4 relative.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import mpi_env, run_mpi

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE, KILL = 30, 10, 17
TRAIN = ["--preset", "tiny", "--n-layer", "2", "--micro-batch-size", "2", "--steps", str(STEPS), "--eval-every", "0",
         "--eval-iters", "1", "--sample-tokens", "0", "--progress", "log", "--log-every", "10",
         "--save-every", str(SAVE)]


FAULTY = str(ROOT / "tests" / "faulty_train.py")     # pympar.train with the PYMPAR_INJECT_* faults


def _launch(args, env=None, timeout=240):
    cmd = [sys.executable, "-m", "pympar.launch", "--program", FAULTY, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(env), cwd=ROOT / "tests", timeout=timeout)


def _records(out):
    return [json.loads(x) for x in (Path(out) / "launch.jsonl").read_text().splitlines()]


def _losses(out):
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows}


def _reference(n, out, n_micro=1):
    run_mpi(n, ["-m", "pympar.train", *TRAIN, "--n-micro", str(n_micro), "--out", str(out)], timeout=180)
    return _losses(out)


KILL_RANK_1 = {"PYMPAR_INJECT_KILL_STEP": KILL, "PYMPAR_INJECT_KILL_RANK": 1}


def test_a_killed_rank_is_restarted_and_the_run_is_the_uninterrupted_one(tmp_path):
    out = tmp_path / "run"
    res = _launch(["-n", 4, "--max-restarts", 2, "--backoff", 0.2, "--", *TRAIN, "--out", out], env=KILL_RANK_1)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = _records(out)
    assert [r["attempt"] for r in recs] == [0, 1] and recs[1]["status"] == 0, recs
    assert recs[0]["status"] != 0 and recs[0]["action"].startswith("restart"), recs[0]
    assert "resumed from" in res.stdout and f"step_{KILL // SAVE * SAVE:08d}" in res.stdout, res.stdout[-3000:]
    assert res.stdout.count("pympar.launch: attempt") == 4      # a start line and an end line per attempt
    got, want = _losses(out), _reference(4, tmp_path / "ref")
    assert sorted(got) == sorted(want) == list(range(STEPS))
    assert all(got[s] == want[s] for s in range(STEPS)), [(s, got[s], want[s]) for s in range(STEPS) if got[s] != want[s]][:3]


def test_a_configuration_error_is_not_restarted(tmp_path):
    out = tmp_path / "run"
    res = _launch(["-n", 2, "--max-restarts", 3, "--", *TRAIN, "--n-head", 3, "--out", out])
    assert res.returncode == 2, res.stdout[-2000:]
    recs = _records(out)
    assert len(recs) == 1 and recs[0]["cause"] == "configuration or data error" and recs[0]["action"] == "stop"


def test_max_restarts_exhausted_says_so(tmp_path):
    out = tmp_path / "run"
    res = _launch(["-n", 2, "--max-restarts", 0, "--", *TRAIN, "--out", out], env=KILL_RANK_1)
    assert res.returncode not in (0, 2, 75), res.stdout[-2000:]
    assert "giving up after 0 restart(s)" in res.stdout and str(out / "launch.jsonl") in res.stdout
    assert len(_records(out)) == 1


def test_layout_for_keeps_the_global_batch():
    from pympar.launch import LaunchError, layout_for

    base = ["--micro-batch-size", "2", "--n-micro", "1", "--out", "o"]
    args, g = layout_for(base, 4, None)
    assert g == 8 and args[-4:] == ["--dp", "4", "--n-micro", "1"]
    args, _ = layout_for(base, 2, g)
    assert args[-4:] == ["--dp", "2", "--n-micro", "2"]
    args, _ = layout_for(base + ["--tp", "2"], 2, g)          # tp 2 on 2 ranks: dp 1, n_micro 4
    assert args[-4:] == ["--dp", "1", "--n-micro", "4"]
    with pytest.raises(LaunchError, match="cannot keep the global batch of 8"):
        layout_for(base, 3, g)
    auto = ["--layout", "auto", "--micro-batch-size", "2", "--n-micro", "2", "--out", "o"]
    args, g = layout_for(auto, 2, None)
    assert g == 8 and "--dp" not in args and args[-2:] == ["--n-micro", "2"]
    assert layout_for(auto, 4, g)[0][-2:] == ["--n-micro", "1"]


def test_supervisor_refuses_what_cannot_run(tmp_path):
    res = _launch(["-n", 2, "--", *TRAIN])
    assert res.returncode == 2 and "must include --out DIR" in res.stderr
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    res = _launch(["--hostfile", hosts, "--min-ranks", 2, "--", *TRAIN, "--out", tmp_path / "r"])
    assert res.returncode == 2 and "1 rank(s) available in" in res.stderr and "below --min-ranks 2" in res.stderr
    hosts.write_text("localhost:3\n")
    res = _launch(["--hostfile", hosts, "--", *TRAIN, "--micro-batch-size", 2, "--tp", 2, "--out", tmp_path / "r"])
    assert res.returncode == 2 and "3 ranks do not divide into pp*tp*cp = 2" in res.stderr
    res = _launch(["--mpiexec", tmp_path / "no-mpiexec", "-n", 2, "--", *TRAIN, "--out", tmp_path / "r"])
    assert res.returncode == 2 and "no such program" in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4)])
def test_elastic_restart_on_the_ranks_the_hostfile_offers(tmp_path, before, after):
    """The hostfile changes as a rank of the first attempt dies (the killed rank writes the cluster
    manager's new file just before its SIGKILL: ordered by the event, not by a race with the back-off);
    the restart takes the new slots, dp and n_micro change so that micro_batch_size x n_micro x dp
    stays 8, and the losses continue the uninterrupted run's on the first world size."""
    out, hosts = tmp_path / "run", tmp_path / "hosts"
    hosts.write_text(f"localhost:{before}\n")
    n_micro = 4 // before                                # global batch 2 x n_micro x dp = 8 sequences
    cmd = [sys.executable, "-m", "pympar.launch", "--program", FAULTY, "--hostfile", str(hosts), "--backoff", "0.2",
           "--max-restarts", "1",
           "--", *TRAIN, "--n-micro", str(n_micro), "--out", str(out)]
    env = dict(KILL_RANK_1, PYMPAR_INJECT_HOSTS_FILE=str(hosts), PYMPAR_INJECT_HOSTS_TEXT=f"localhost:{after}\\n")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(env),
                       cwd=ROOT / "tests", timeout=240)
    text = p.stdout
    assert p.returncode == 0, text[-3000:]
    recs = _records(out)
    assert [r["ranks"] for r in recs] == [before, after], recs
    args = recs[1]["args"]
    assert args[args.index("--n-micro") + 1] == str(4 // after) and args[args.index("--dp") + 1] == str(after), args
    got, want = _losses(out), _reference(before, tmp_path / "ref", n_micro)
    assert sorted(got) == sorted(want) == list(range(STEPS))
    for s in range(STEPS):
        for a, b in zip(got[s], want[s]):
            assert a == pytest.approx(b, rel=1e-4), (s, got[s], want[s])


def test_a_hang_ended_by_the_watchdog_is_restarted(tmp_path):
    """A rank that stops answering (PYMPAR_INJECT_HANG_STEP) makes the others' collectives time out:
    the watchdog ends the job, the supervisor restarts it, and the run completes."""
    out = tmp_path / "run"
    env = {"PYMPAR_INJECT_HANG_STEP": KILL, "PYMPAR_INJECT_HANG_RANK": 0}
    res = _launch(["-n", 2, "--max-restarts", 1, "--backoff", 0.2, "--", *TRAIN, "--comm-timeout", 4, "--out", out],
                  env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = _records(out)
    assert len(recs) == 2 and recs[0]["status"] not in (0, 2, 75) and recs[1]["status"] == 0, recs
    assert sorted(_losses(out)) == list(range(STEPS))


def test_a_frozen_rank_is_ended_by_its_heartbeat_not_the_communicator_timeout(tmp_path):
    """Rank 1 SIGSTOPs itself at step 17 (a frozen process: its heartbeat thread stops too). With the
    communicator's default timeout (300 s) and --heartbeat-timeout 5 the supervisor sees the beat stop,
    kills the frozen rank, says which, and the restart finishes with the uninterrupted run's losses,
    bit for bit."""
    out = tmp_path / "run"
    env = {"PYMPAR_INJECT_FREEZE_STEP": KILL, "PYMPAR_INJECT_FREEZE_RANK": 1}
    t0 = time.monotonic()
    res = _launch(["-n", 2, "--max-restarts", 1, "--backoff", 0.2, "--heartbeat-timeout", 5, "--", *TRAIN,
                   "--out", out], env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = _records(out)
    assert len(recs) == 2 and recs[1]["status"] == 0, recs
    assert recs[0]["cause"].startswith("rank 1 (pid ") and "stopped beating for more than 5 s" in recs[0]["cause"], recs
    assert time.monotonic() - t0 < 200, "the communicator's timeout (300 s) would have ended it later"
    got, want = _losses(out), _reference(2, tmp_path / "ref")
    assert sorted(got) == list(range(STEPS)) and all(got[s] == want[s] for s in range(STEPS))
    assert not list((out / ".heartbeat").iterdir()), "every rank that ends removes its heartbeat"


def test_a_busy_rank_keeps_beating(tmp_path):
    """A rank whose main thread does not return (sleeping outside MPI, as a long computation
    would) is not frozen: its heartbeat goes on, so --heartbeat-timeout 4 does not fire, and the others'
    collectives end the attempt at --comm-timeout 12 (the watchdog's status, not the supervisor's kill)."""
    out = tmp_path / "run"
    env = {"PYMPAR_INJECT_HANG_STEP": KILL, "PYMPAR_INJECT_HANG_RANK": 0}
    res = _launch(["-n", 2, "--max-restarts", 0, "--heartbeat-timeout", 4, "--", *TRAIN, "--comm-timeout", 12,
                   "--out", out], env=env)
    recs = _records(out)
    assert len(recs) == 1 and recs[0]["status"] not in (0, 2, 75), recs
    assert "stopped beating" not in recs[0]["cause"] and recs[0]["seconds"] > 12, recs
    assert "timed out" in res.stderr + res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_an_explicit_resume_is_never_turned_into_a_fresh_start(tmp_path):
    """--resume PATH given to the supervisor, and the first attempt dies before the job saves a checkpoint
    of its own: the retry resumes from PATH again (it used to retry with --resume auto, find nothing in
    OUT/checkpoints, train from step 0 and exit 0 -- the run the user asked to continue silently lost).
    The finished run's steps are the uninterrupted run's, bit for bit."""
    ref = tmp_path / "ref"
    want = _reference(2, ref)                                  # saves steps 10, 20 (and 30)
    start = ref / "checkpoints" / f"step_{2 * SAVE:08d}"
    assert start.is_dir()
    out = tmp_path / "run"
    kill = {"PYMPAR_INJECT_KILL_STEP": 2 * SAVE + 5, "PYMPAR_INJECT_KILL_RANK": 1}   # before its first save
    res = _launch(["-n", 2, "--max-restarts", 1, "--backoff", 0.2, "--", *TRAIN, "--resume", start, "--out", out],
                  env=kill)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = _records(out)
    assert [r["attempt"] for r in recs] == [0, 1] and recs[0]["status"] != 0, recs
    assert all(r["args"][r["args"].index("--resume") + 1] == str(start) for r in recs), [r["args"] for r in recs]
    got = _losses(out)
    assert sorted(got) == list(range(2 * SAVE, STEPS)), sorted(got)
    assert all(got[s] == want[s] for s in got), [(s, got[s], want[s]) for s in got if got[s] != want[s]][:3]


# --- failures the supervisor repairs: a corrupt newest checkpoint, a full disk -------------------------

def _flip(f):
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x40               # the middle of a shard: tensor data, past the header
    f.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", ["a flipped byte in a shard", pytest.param("a torn manifest", marks=pytest.mark.slow),
                                    "every checkpoint"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_that_verifies(tmp_path, damage):
    """A job killed after saving steps 10 and 20, then the newest checkpoint damaged. Rerunning the supervisor:
    the resume fails its checksum (status 2), which used to stop the job as a configuration error with a good
    checkpoint beside it. Now step_20 is moved aside, the job resumes from step_10 and ends with the
    uninterrupted run's losses, bit for bit. With every checkpoint damaged it stops and says so: no fresh start."""
    out = tmp_path / "run"
    res = _launch(["-n", 2, "--max-restarts", 0, "--", *TRAIN, "--out", out],
                  env={"PYMPAR_INJECT_KILL_STEP": 25, "PYMPAR_INJECT_KILL_RANK": 1})
    assert res.returncode not in (0, 2), res.stdout[-2000:]
    ck = out / "checkpoints"
    s10, s20 = ck / f"step_{SAVE:08d}", ck / f"step_{2 * SAVE:08d}"
    if damage == "a torn manifest":
        m = s20 / "manifest.json"
        m.write_bytes(m.read_bytes()[:m.stat().st_size // 2])
    else:
        _flip(s20 / "rank_00000.safetensors")
    if damage == "every checkpoint":
        _flip(s10 / "rank_00000.safetensors")
    before = (out / "metrics.jsonl").read_text()
    res = _launch(["-n", 2, "--max-restarts", 2, "--backoff", 0.2, "--", *TRAIN, "--out", out])
    recs = _records(out)[1:]                         # the second supervisor's attempts
    if damage == "every checkpoint":
        assert res.returncode == 2, res.stdout[-3000:]
        assert "no other checkpoint" in res.stdout and len(recs) == 1 and recs[0]["action"] == "stop", res.stdout[-3000:]
        assert s20.is_dir() and (out / "metrics.jsonl").read_text() == before     # nothing moved, nothing trained
        return
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert [r["status"] for r in recs] == [2, 0] and "does not verify" in recs[0]["cause"], recs
    assert s10.name in recs[0]["repair"] and (ck / (s20.name + ".corrupt")).is_dir(), recs[0]
    got, want = _losses(out), _reference(2, tmp_path / "ref")
    assert sorted(got) == list(range(STEPS)) and all(got[s] == want[s] for s in range(STEPS))


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (a disk that fills), where this user may mount one."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:80]}): the RLIMIT_FSIZE case covers the status")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_a_full_disk_waits_for_space_and_resumes(tmp_path, small_disk):
    """Another file takes the disk's last byte at step 17; the save at step 20 fails (ENOSPC). The trainer
    used to exit 2, which the supervisor never restarts. Now it exits 74; the supervisor removes what
    --keep allows, waits until a checkpoint fits (the test frees the space when it says it waits), and
    resumes from step 15: the uninterrupted run's losses, bit for bit."""
    import threading
    out, ballast = small_disk / "run", small_disk / "ballast"
    env = {"PYMPAR_INJECT_FILL_STEP": 17, "PYMPAR_INJECT_FILL_PATH": str(ballast)}
    cmd = [sys.executable, "-m", "pympar.launch", "--program", FAULTY, "-n", "2", "--max-restarts", "2", "--backoff",
           "0.2", "--", *TRAIN, "--save-every", "5", "--keep", "2", "--out", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(env),
                         cwd=ROOT / "tests")
    timer = threading.Timer(240, p.kill)
    timer.start()
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "waiting for disk space" in line and ballast.exists():
                ballast.unlink()                  # an operator frees the space
        rc = p.wait()
    finally:
        timer.cancel()
    text = "".join(lines)
    assert rc == 0, text[-4000:]
    assert "the disk is full" in text and "waiting for disk space" in text and "removed step_00000010" in text, text[-4000:]
    recs = _records(out)
    assert [r["status"] for r in recs] == [74, 0] and "removed step_00000010" in recs[0]["repair"], recs
    got, want = _losses(out), _reference(2, tmp_path / "ref")
    assert sorted(got) == list(range(STEPS)) and all(got[s] == want[s] for s in range(STEPS))


def test_a_file_size_limit_is_a_full_disk_and_is_restarted(tmp_path):
    """RLIMIT_FSIZE (where no tmpfs can be mounted): the save's write fails with EFBIG, the trainer exits 74
    with one line, the supervisor restarts from the previous checkpoint at once (the disk has room)."""
    out = tmp_path / "run"
    res = _launch(["-n", 2, "--max-restarts", 1, "--backoff", 0.2, "--", *TRAIN, "--out", out],
                  env={"PYMPAR_INJECT_FSIZE_STEP": 17})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stderr.count("the disk is full") == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    recs = _records(out)
    assert [r["status"] for r in recs] == [74, 0], recs
    got, want = _losses(out), _reference(2, tmp_path / "ref")
    assert sorted(got) == list(range(STEPS)) and all(got[s] == want[s] for s in range(STEPS))


def test_an_explicit_resume_that_does_not_verify_stops_and_says_so(tmp_path):
    """--resume PATH naming a damaged checkpoint: the job's status 2 is not repaired by falling back (the user
    chose that checkpoint) and never becomes a fresh start; the supervisor says the checkpoint does not verify."""
    ref = tmp_path / "ref"
    _reference(2, ref)
    start = ref / "checkpoints" / f"step_{2 * SAVE:08d}"
    _flip(start / "rank_00000.safetensors")
    out = tmp_path / "run"
    res = _launch(["-n", 2, "--max-restarts", 2, "--backoff", 0.2, "--", *TRAIN, "--resume", start, "--out", out])
    assert res.returncode == 2, res.stdout[-3000:]
    recs = _records(out)
    assert len(recs) == 1 and "the checkpoint --resume names does not verify" in recs[0]["cause"], recs
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()   # nothing trained


def test_three_kills_and_a_hang_in_one_run(tmp_path):
    """One job meets a fault in each of four attempts (faulty_train.py's per-attempt variables): rank 1
    killed at step 17, rank 0 at 23, rank 1 at 21, rank 0 hung at 25 (the watchdog ends it after
    --comm-timeout 4); the fifth attempt finishes, and every step's loss and gradient norm is the
    uninterrupted run's, bit for bit."""
    out = tmp_path / "run"
    env = {"PYMPAR_INJECT_KILL_STEP_0": 17, "PYMPAR_INJECT_KILL_RANK_0": 1,
           "PYMPAR_INJECT_KILL_STEP_1": 23, "PYMPAR_INJECT_KILL_RANK_1": 0,
           "PYMPAR_INJECT_KILL_STEP_2": 21, "PYMPAR_INJECT_KILL_RANK_2": 1,
           "PYMPAR_INJECT_HANG_STEP_3": 25, "PYMPAR_INJECT_HANG_RANK_3": 0}
    res = _launch(["-n", 2, "--max-restarts", 4, "--backoff", 0.2, "--", *TRAIN, "--comm-timeout", 4, "--out", out],
                  env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = _records(out)
    assert len(recs) == 5 and all(r["status"] not in (0, 2, 75) for r in recs[:4]) and recs[4]["status"] == 0, recs
    resumed = [line.rsplit(" at step ", 1)[1] for line in res.stdout.splitlines() if "resumed from" in line]
    assert resumed == ["10", "20", "20", "20"], resumed
    got, want = _losses(out), _reference(2, tmp_path / "ref")
    assert sorted(got) == list(range(STEPS)) and all(got[s] == want[s] for s in range(STEPS))
