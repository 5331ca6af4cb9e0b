"""Supervise a training job: run it under mpiexec, restart it when it fails, on as many ranks as
the hostfile offers, with the same training run.

    python -m pympar.launch -n 4 --max-restarts 3 -- --preset small --steps 400 --save-every 50 --out runs/a
    python -m pympar.launch -n 8 --hostfile hosts --min-ranks 4 -- --preset small --steps 400 --out runs/a

Everything after ``--`` goes to ``python -m pympar.train`` (or to ``--program SCRIPT``, a script
that calls ``pympar.train.main``); it must name ``--out`` (where the checkpoints that a restart
resumes from live). Each attempt runs the installed ``mpiexec`` (or
``--mpiexec PATH``) and is watched to its end:

    exit 0                     done: the supervisor exits 0
    exit 2                     a configuration or data error: not restarted (it would fail again),
                               unless the job was resuming OUT/checkpoints' newest checkpoint and that
                               one does not verify (a flipped byte, a truncated file): it is moved aside
                               (step_N.corrupt), ``latest`` names the newest checkpoint that verifies,
                               and the job is restarted from there; with none, the supervisor stops
    exit 74                    a checkpoint could not be written, the disk full: the partial save and
                               the checkpoints beyond --keep minus one are removed, the supervisor
                               waits (up to --disk-wait seconds, backing off) until the disk holds
                               another checkpoint, and restarts from the previous one
    exit 75                    stopped on request (a signal; pympar.train saved): restarted
    a rank stops beating       its process frozen (SIGSTOP, stuck holding the interpreter): after
                               --heartbeat-timeout seconds the supervisor kills it, which ends the
                               job, and restarts it (the communicator's timeout, 300 s by default,
                               would catch it too, later; a slow rank or collective keeps beating)
    anything else              a rank killed, the watchdog's abort, a node gone: restarted
    the supervisor signalled   SIGTERM/SIGINT/SIGUSR1 are passed to the job (which saves and exits 75)
                               and the supervisor stops without restarting, with that status

Every attempt runs with ``--resume auto``, so rerunning the supervisor continues a stopped job; a
``--resume PATH`` the user gave is kept until the job has saved a checkpoint of its own under
OUT/checkpoints (never replaced by ``auto`` while that would start the run afresh). A restart comes after ``--backoff`` seconds
(doubling each time, at most a minute), up to ``--max-restarts`` times; then the supervisor exits with the last
attempt's status and says so. Every attempt and its cause are one line on the terminal and one
JSON record in OUT/launch.jsonl.

Elastic: with ``--hostfile FILE`` (MPICH hydra's ``host[:slots]`` lines) the ranks of each attempt
are the slots the file lists when the attempt starts (at most ``-n`` when given), so a cluster
manager or a person can shrink or grow the job between attempts; ``--min-ranks M`` refuses to start
an attempt below M. When the world size changes, the layout is chosen again by the trainer's rule
(pp, tp, cp, ep as given; dp takes the rest), or by the planner with ``--layout auto``, and the
global batch is kept: ``--n-micro`` becomes global_batch / (micro_batch_size x dp) (with
``--layout auto``: / (micro_batch_size x world), the planner's definition), refused with a message
when it does not divide, so the run continues the same training trajectory from the checkpoint,
resharded as the trainer can.

Faults injected with PYMPAR_INJECT_* (tests/faulty_train.py, run with --program) fire in the first attempt only:
the supervisor tells the trainer its attempt number (PYMPAR_LAUNCH_ATTEMPT).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .resilience import DISK_FULL_STATUS, RESUMABLE_STATUS

CONFIG_STATUS = 2


class LaunchError(ValueError):
    """A supervisor argument or an attempt that cannot start, said in one line."""


def parse(argv):
    if "--" in argv:
        i = argv.index("--")
        own, train = argv[:i], argv[i + 1:]
    else:
        own, train = argv, []
    ap = argparse.ArgumentParser(prog="python -m pympar.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--np", type=int, default=None, help="ranks (with --hostfile: at most this many)")
    ap.add_argument("--max-restarts", type=int, default=3, help="restarts after failures (default 3)")
    ap.add_argument("--hostfile", default=None, help="MPICH hydra hostfile (host[:slots] per line), re-read per attempt")
    ap.add_argument("--min-ranks", type=int, default=1, help="refuse to start an attempt with fewer ranks")
    ap.add_argument("--mpiexec", default=None, help="the mpiexec to run (default: the one beside this Python)")
    ap.add_argument("--backoff", type=float, default=2.0, help="seconds before the first restart (doubling)")
    ap.add_argument("--disk-wait", type=float, default=600.0,
                    help="on a full disk, seconds to wait for space before giving up (default 600)")
    ap.add_argument("--heartbeat-timeout", type=float, default=60.0,
                    help="end an attempt when a rank's heartbeat (a thread in every rank, beating in "
                         "OUT/.heartbeat) has stopped this many seconds: a frozen process; 0: off (default 60)")
    ap.add_argument("--program", default=None,
                    help="a Python script to run instead of -m pympar.train, with the same arguments (one that "
                         "calls pympar.train.main, e.g. with hooks of its own; default: python -m pympar.train)")
    a = ap.parse_args(own)
    if a.np is None and a.hostfile is None:
        raise LaunchError("give -n N (ranks) or --hostfile FILE")
    if a.np is not None and a.np < 1 or a.max_restarts < 0 or a.min_ranks < 1 or a.backoff < 0 or a.disk_wait < 0 \
            or not (a.heartbeat_timeout == 0 or a.heartbeat_timeout >= 1):
        raise LaunchError("-n, --min-ranks must be >= 1; --max-restarts, --backoff, --disk-wait >= 0; "
                          "--heartbeat-timeout 0 (off) or at least 1 second")
    if a.program is not None and not Path(a.program).is_file():
        raise LaunchError(f"--program {a.program}: no such file")
    if not train:
        raise LaunchError("nothing to train: give the pympar.train arguments after --")
    if _flag(train, "--out") is None:
        raise LaunchError("the pympar.train arguments must include --out DIR: a restart resumes from DIR/checkpoints")
    return a, train


def _flag(args, name):
    """The value of ``--name V`` or ``--name=V`` in args (the last one), else None."""
    val = None
    for i, x in enumerate(args):
        if x == name and i + 1 < len(args):
            val = args[i + 1]
        elif x.startswith(name + "="):
            val = x.split("=", 1)[1]
    return val


def _without(args, *names):
    """args without the given flags and their values."""
    out, skip = [], False
    for x in args:
        if skip:
            skip = False
            continue
        if x in names:
            skip = True
            continue
        if any(x.startswith(n + "=") for n in names):
            continue
        out.append(x)
    return out


def hostfile_ranks(path) -> int:
    """Slots a hydra hostfile offers: the sum over its lines of ``host[:slots]`` (1 when omitted)."""
    total = 0
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise LaunchError(f"--hostfile {path}: {e.strerror}") from None
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        try:
            n = int(slots) if slots else 1
        except ValueError:
            raise LaunchError(f"--hostfile {path}: {line!r} is not host[:slots]") from None
        total += max(n, 0)
    return total


def layout_for(train, world, global_batch):
    """(train arguments for this world size, global batch): dp takes what pp*tp*cp leave; n_micro
    keeps the global batch of the first attempt (LaunchError when it cannot)."""
    mbs = int(_flag(train, "--micro-batch-size") or 8)
    if _flag(train, "--layout") == "auto":     # the planner's global batch: mbs x n_micro x world
        if global_batch is None:
            global_batch = mbs * int(_flag(train, "--n-micro") or 1) * world
        if global_batch % (mbs * world):
            raise LaunchError(f"{world} ranks cannot keep the global batch of {global_batch} sequences with "
                              f"--layout auto and micro-batches of {mbs}: it needs a world dividing {global_batch // mbs}")
        return _without(train, "--n-micro") + ["--n-micro", str(global_batch // (mbs * world))], global_batch
    get = {k: int(_flag(train, f"--{k}") or 1) for k in ("pp", "tp", "cp")}
    rest = get["pp"] * get["tp"] * get["cp"]
    if world % rest:
        raise LaunchError(f"{world} ranks do not divide into pp*tp*cp = {rest}: the job needs a multiple of {rest}")
    dp = world // rest
    if global_batch is None:
        given_dp = _flag(train, "--dp")
        dp0 = int(given_dp) if given_dp else dp
        global_batch = mbs * int(_flag(train, "--n-micro") or 1) * dp0
    if global_batch % (mbs * dp):
        raise LaunchError(f"{world} ranks (dp={dp}) cannot keep the global batch of {global_batch} sequences with "
                          f"micro-batches of {mbs}: it needs dp dividing {global_batch // mbs}")
    n_micro = global_batch // (mbs * dp)
    args = _without(train, "--dp", "--n-micro") + ["--dp", str(dp), "--n-micro", str(n_micro)]
    return args, global_batch


def find_mpiexec(given=None) -> str:
    if given:
        found = shutil.which(given)
        if not found:
            raise LaunchError(f"--mpiexec {given}: no such program (or not executable)")
        return found
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else (shutil.which("mpiexec") or shutil.which("mpirun"))
    if not found:
        raise LaunchError("no mpiexec found: pip install 'pympar[mpich]', load your MPI, or give --mpiexec PATH")
    return found


def cause_of(status: int) -> str:
    if status == 0:
        return "done"
    if status == CONFIG_STATUS:
        return "configuration or data error"
    if status == RESUMABLE_STATUS:
        return "stopped on request (checkpoint saved)"
    if status == DISK_FULL_STATUS:
        return "the disk is full (a checkpoint could not be written; the previous one is kept)"
    if status < 0 or status > 128:
        sig = -status if status < 0 else status - 128
        try:
            return f"a process ended by {signal.Signals(sig).name}"
        except ValueError:
            return f"exit status {status}"
    return f"failed with exit status {status} (a rank died or the watchdog aborted)"


class Supervisor:
    def __init__(self, a, train):
        self.a, self.train = a, train
        self.out = Path(_flag(train, "--out"))
        self.mpiexec = find_mpiexec(a.mpiexec)
        self.child = None
        self.signalled = 0

    def _on_signal(self, signum, frame):
        self.signalled = self.signalled or signum
        if self.child is not None and self.child.poll() is None:
            try:
                self.child.send_signal(signum)      # hydra passes it on to the ranks (they save, exit 75)
            except ProcessLookupError:
                pass

    def resume_for(self, attempt: int) -> str:
        """What an attempt resumes from: the user's --resume PATH on the first attempt, and on a retry
        until this job has saved a checkpoint of its own; else auto (OUT/checkpoints' newest, or a
        fresh start when the user asked for none)."""
        given = _flag(self.train, "--resume")
        if given in (None, "auto") or (attempt and self._saved()):
            return "auto"
        return given

    def _saved(self) -> bool:
        from .checkpoint import CheckpointError, resolve
        try:
            resolve(self.out / "checkpoints")
            return True
        except CheckpointError:
            return False

    # --- failures the supervisor can repair ----------------------------------------------------
    @property
    def root(self) -> Path:
        return self.out / "checkpoints"

    def _broken_newest(self):
        """(path, problem) when the checkpoint a --resume auto loads does not verify, else None (no
        checkpoint yet, or a sound one: the job's status 2 was a configuration error)."""
        from .checkpoint import CheckpointError, resolve
        from .checkpoint import layout_io as L

        if not (self.root / L.LATEST).exists() and not L.list_steps(self.root):
            return None
        try:
            path = resolve(self.root)
        except CheckpointError as e:
            return Path(e.path), e.problem
        problem = self._broken(path)
        return None if problem is None else (path, problem)

    @staticmethod
    def _broken(path):
        """What is wrong with checkpoint ``path``, or None when it verifies."""
        from .checkpoint import Checkpoint, CheckpointError

        try:
            Checkpoint(path).verify_all()
            return None
        except CheckpointError as e:
            return f"{Path(e.path).name}: {e.problem}"

    def _fall_back(self, broken):
        """Move the broken newest checkpoint aside and point ``latest`` at the newest one that
        verifies; what was done, or None (and nothing moved) when none verifies."""
        from .checkpoint import layout_io as L

        bad, problem = broken
        good = None
        for _, p in reversed(L.list_steps(self.root)):
            if p.resolve() != bad.resolve() and self._broken(p) is None:
                good = p
                break
        if good is None:
            print(f"pympar.launch: the newest checkpoint {bad} does not verify ({problem}) and no other checkpoint "
                  f"in {self.root} does: not restarting (it would start the run afresh)", flush=True)
            return None
        if bad.is_dir() and bad.parent.resolve() == self.root.resolve():
            aside = bad.with_name(bad.name + ".corrupt")
            n = 1
            while aside.exists():
                aside, n = bad.with_name(f"{bad.name}.corrupt{n}"), n + 1
            bad.rename(aside)
            moved = f"moved to {aside.name}"
        else:
            moved = "a broken 'latest' pointer"
        L.write_text_atomic(self.root / L.LATEST, good.name + "\n")
        said = f"{bad.name} {moved}: resuming from {good.name}, the newest checkpoint that verifies"
        print(f"pympar.launch: the newest checkpoint {bad.name} does not verify ({problem}); {said}", flush=True)
        return said

    def _make_room(self):
        """After a full disk: remove the partial save and the checkpoints beyond --keep minus one (the
        next save makes --keep again), then wait, backing off, until the disk has room for another
        checkpoint as large as the newest; what was done, or None when --disk-wait passes first."""
        from .checkpoint import layout_io as L

        removed = []
        if self.root.is_dir():
            L.clean_stale(self.root)
            keep = _flag(self.train, "--keep")
            steps = [p for _, p in L.list_steps(self.root)]
            try:
                latest = L.read_latest(self.root)
            except ValueError:                  # a damaged pointer: keep the newest (never in the slice)
                latest = None
            if keep and int(keep) > 0:
                for p in steps[:-max(int(keep) - 1, 1)]:
                    if latest is None or p.resolve() != latest.resolve():
                        L.remove_tree(p)
                        removed.append(p.name)
        newest = L.list_steps(self.root)[-1][1] if L.list_steps(self.root) else None
        need = (sum(f.stat().st_size for f in newest.iterdir() if f.is_file()) if newest else 0) + (1 << 20)
        where = self.root if self.root.is_dir() else self.out
        if removed:
            print(f"pympar.launch: removed {', '.join(removed)} (beyond --keep {keep} while the next one is written)",
                  flush=True)
        waited, pause = 0.0, max(self.a.backoff, 0.5)
        while True:
            free = shutil.disk_usage(where).free
            if free >= need:
                return (f"removed {', '.join(removed) or 'nothing'}; {free / 2**20:.1f} MiB free after waiting "
                        f"{waited:.0f} s")
            if waited >= self.a.disk_wait:
                print(f"pympar.launch: {free / 2**20:.1f} MiB free on {where} after {waited:.0f} s, a checkpoint "
                      f"needs {need / 2**20:.1f} MiB: giving up (free space, then run the same command again)",
                      flush=True)
                return None
            print(f"pympar.launch: waiting for disk space: {free / 2**20:.1f} MiB free on {where}, a checkpoint "
                  f"needs {need / 2**20:.1f} MiB (next look in {pause:.1f} s)", flush=True)
            time.sleep(pause)
            waited += pause
            pause = min(2 * pause, 60.0, max(self.a.disk_wait - waited, 0.5))

    # --- a frozen rank --------------------------------------------------------------------------
    def _heartbeat_folder(self, env):
        """OUT/.heartbeat, emptied, named to the ranks in env; None when off or not writable."""
        if not self.a.heartbeat_timeout:
            return None
        folder = self.out / ".heartbeat"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for f in folder.iterdir():
                f.unlink()
        except OSError:
            return None
        env["PYMPAR_HEARTBEAT_DIR"] = str(folder)
        env["PYMPAR_HEARTBEAT_INTERVAL"] = str(min(5.0, max(0.1, self.a.heartbeat_timeout / 10)))
        return folder

    def _watch(self, folder):
        """Wait for the attempt; with heartbeats, end it when a rank's beat has not changed for
        --heartbeat-timeout seconds of the supervisor's own clock (no clock is compared across
        nodes). Returns (status, the cause when the supervisor ended it, else None)."""
        from .resilience import read_heartbeat
        if folder is None:
            return self.child.wait(), None
        limit, seen, last_poll = self.a.heartbeat_timeout, {}, time.monotonic()
        poll = min(1.0, limit / 4)
        while True:
            try:
                return self.child.wait(timeout=poll), None
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now - last_poll > limit / 2:          # the supervisor itself was not running: start over
                seen.clear()
            last_poll = now
            try:
                names = sorted(f.name for f in folder.iterdir() if f.suffix != ".tmp")
            except OSError:
                names = []
            for name in names:
                beat = read_heartbeat(folder / name)
                if beat is not None and seen.get(name, (None,))[0] != beat:
                    seen[name] = (beat, now)
            for name in list(seen):
                if name not in names:                # the rank ended on its own
                    del seen[name]
            stale = [(name, beat) for name, (beat, t) in seen.items() if now - t > limit]
            if stale:
                name, (pid, host, _) = stale[0]
                cause = (f"rank {int(name.split('_')[1])} (pid {pid} on {host}) stopped beating for more than "
                         f"{limit:g} s: a frozen process")
                return self._end_attempt(pid, host), cause

    def _ours(self, pid) -> bool:
        """Is pid a process of this attempt (a descendant of its mpiexec), on this host?"""
        from .metrics import process_ancestors

        return any(p == self.child.pid for p, _ in process_ancestors(pid))

    def _end_attempt(self, pid, host):
        """Kill the frozen rank where it runs here and is this attempt's (mpiexec then ends the job as
        for any killed rank), else end mpiexec; the attempt's status."""
        import socket
        if host == socket.gethostname() and self._ours(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        else:
            self.child.kill()                   # hydra's proxies take the ranks with them
        try:
            return self.child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.child.kill()
            return self.child.wait()

    def _log(self, rec):
        """One JSON record in OUT/launch.jsonl; a full or failing disk costs the record, not the job."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "launch.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            print(f"pympar.launch: warning: could not write {self.out / 'launch.jsonl'} ({e.strerror or e}); "
                  f"the record above is on the terminal only", flush=True)

    def ranks(self) -> int:
        n = self.a.np
        if self.a.hostfile:
            slots = hostfile_ranks(self.a.hostfile)
            n = slots if n is None else min(n, slots)
        if n < self.a.min_ranks:
            raise LaunchError(f"{n} rank(s) available{' in ' + self.a.hostfile if self.a.hostfile else ''}, "
                              f"below --min-ranks {self.a.min_ranks}: not starting")
        return n

    def run(self) -> int:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(s, self._on_signal)
        global_batch, status, backoff = None, 1, self.a.backoff
        for attempt in range(self.a.max_restarts + 1):
            n = self.ranks()
            args, global_batch = layout_for(self.train, n, global_batch)
            resume = self.resume_for(attempt)
            args = _without(args, "--resume") + ["--resume", resume]
            cmd = [self.mpiexec, "-n", str(n)] + (["-f", self.a.hostfile] if self.a.hostfile else []) + \
                [sys.executable, *(["-m", "pympar.train"] if self.a.program is None else [self.a.program]), *args]
            env = dict(os.environ, PYMPAR_LAUNCH_ATTEMPT=str(attempt))   # the job's environment, passed on
            beats = self._heartbeat_folder(env)
            t0 = time.time()
            print(f"pympar.launch: attempt {attempt + 1}/{self.a.max_restarts + 1}: {n} ranks, "
                  f"{' '.join(args)}", flush=True)
            self.child = subprocess.Popen(cmd, env=env)
            status, stalled = self._watch(beats)
            self.child = None
            cause = cause_of(status) if stalled is None else stalled
            broken = self._broken_newest() if status == CONFIG_STATUS and resume == "auto" else None
            if broken is not None:
                cause = f"the newest checkpoint does not verify ({broken[1]})"
            elif status == CONFIG_STATUS and resume != "auto":
                named = self._broken(resume)
                if named is not None:            # the user's own choice: said, never replaced
                    cause = f"the checkpoint --resume names does not verify ({named}): not starting afresh"
            final = (status == 0 or (status == CONFIG_STATUS and broken is None) or bool(self.signalled)
                     or attempt == self.a.max_restarts)
            repair = None
            if not final and broken is not None:
                repair = self._fall_back(broken)
            elif not final and status == DISK_FULL_STATUS:
                repair = self._make_room()
            gave_up = not final and repair is None and (broken is not None or status == DISK_FULL_STATUS)
            action = "stop" if final or gave_up else f"restart in {backoff:.0f} s"
            self._log(dict(attempt=attempt, ranks=n, args=args, started=t0, seconds=round(time.time() - t0, 3),
                           status=status, cause=cause, action=action, **({"repair": repair} if repair else {})))
            print(f"pympar.launch: attempt {attempt + 1} ended: {cause} (status {status}); {action}", flush=True)
            if status == 0:
                return 0
            if gave_up or (status == CONFIG_STATUS and broken is None):
                return status
            if self.signalled:
                print(f"pympar.launch: stopped by {signal.Signals(self.signalled).name}; run the same command "
                      f"again to continue from {self.out}/checkpoints", flush=True)
                return status
            if attempt == self.a.max_restarts:
                break
            time.sleep(backoff)
            backoff = min(2 * backoff, 60.0) if backoff else 0.0
        print(f"pympar.launch: giving up after {self.a.max_restarts} restart(s): the last attempt {cause_of(status)} "
              f"(status {status}); see {self.out}/launch.jsonl", flush=True)
        return status if status else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        a, train = parse(argv)
        return Supervisor(a, train).run()
    except LaunchError as e:
        print(f"pympar.launch: error: {e}", file=sys.stderr, flush=True)
        return CONFIG_STATUS


if __name__ == "__main__":
    sys.exit(main())
