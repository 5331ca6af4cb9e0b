"""The trainer's defences: non-finite steps, checkpoints of a run, stop on request.

Non-finite steps. The runner skips any step whose loss or synced gradients are not finite
(the verdict is the same on every rank), so nothing non-finite reaches the weights, the
optimiser state or a checkpoint. :class:`BadStepGuard` counts consecutive skipped steps
and stops the run after ``--max-bad-steps`` of them, naming the first parameter (in
named_parameters order, on the lowest rank that has one) whose gradient was non-finite. With float16
the loss scaler halves the scale on each skipped step; only steps skipped with the scale
already at its floor count against the limit.

Checkpoints of a run. ``save_run`` / ``restore_run`` put the runner's model and optimiser
through pympar.checkpoint with the trainer's position: the next step (the data stream is a
function of (seed, step), so this is the data position), the loss scaler's state and the
bad-step count. The training loop itself draws no random numbers (the sampler at the end
seeds its own generator from --seed), so there is no other RNG state to carry.

Stop on request. SIGTERM, SIGINT and SIGUSR1 -- to every rank (srun, a launcher forwarding
them) or to one -- stop the run at the end of the step during which some rank got one
(``StopRequest``; the flag rides on the step's world allreduce, no collective of its own): with
--out the ranks write a checkpoint, rank 0 says where and how to resume, and every rank exits with
status 75 (``RESUMABLE_STATUS``); without --out they say nothing could be saved and exit 75 too.

Heartbeat. Under pympar.launch (which sets ``PYMPAR_HEARTBEAT_DIR``) every rank runs a daemon
thread that rewrites ``rank_NNNNN`` there every ``PYMPAR_HEARTBEAT_INTERVAL`` seconds (read by config.py) with its pid,
host and a counter (:class:`Heartbeat`). The thread needs nothing but the interpreter: a rank that is
slow, or waiting in a long collective, keeps beating; a process that is frozen (SIGSTOP, a debugger,
a call stuck holding the interpreter, a node that stopped scheduling it) does not, and the supervisor
ends the job after ``--heartbeat-timeout`` seconds instead of the communicator's timeout. A rank that
ends removes its file first (it is no longer watched).

Faults for the tests (a NaN gradient, a killed or hung rank) are injected by the tests' own
entry point, tests/faulty_train.py, through ``pympar.train.main(argv, faults=...)``; a normal run
constructs no injector.
"""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import asdict, is_dataclass
from pathlib import Path

import numpy as np

from .backend import xp_of

STOP_STATUS = 4            # exit status when the run stops on non-finite steps
RESUMABLE_STATUS = 75      # stopped on request (SIGTERM/SIGINT/SIGUSR1): resume it (sysexits' EX_TEMPFAIL)
DISK_FULL_STATUS = 74      # a checkpoint could not be written for lack of space; the previous one is kept (EX_IOERR)
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class Heartbeat:
    """A rank's heartbeat file (the module docstring), beaten by a daemon thread; ``None`` from
    :meth:`start` when no supervisor asked for one. ``stop()`` ends the thread and
    removes the file (the supervisor stops watching a rank that has ended on its own)."""

    WIDTH = 96                                   # the record's fixed size: rewritten in place

    def __init__(self, folder, rank: int, interval: float):
        import socket
        self.path = Path(folder) / f"rank_{rank:05d}"
        self._who = f"{os.getpid()} {socket.gethostname()}"
        self.interval, self.beats = interval, 0
        self._done = threading.Event()
        self._lock = threading.Lock()
        # one file, made once and then overwritten in place: a beat needs no new block, so a full
        # disk or a quota does not stop a healthy rank's heartbeat (a replaced file would)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._beat()                                          # the first beat before any work
        self._thread = threading.Thread(target=self._run, name="pympar-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, env, rank: int):
        """The heartbeat pympar.launch asked for (``env``: config.Environment), or None."""
        if not env.heartbeat_dir:
            return None
        try:
            return cls(env.heartbeat_dir, rank, env.heartbeat_interval)
        except OSError:                            # an unwritable folder: the job runs unwatched
            return None

    def _beat(self):
        with self._lock:
            if self._fd is None:                         # stopped: the file is gone, never write it back
                return
            self.beats += 1
            rec = f"{self._who} {self.beats}".ljust(self.WIDTH - 1)[:self.WIDTH - 1] + "\n"
            try:
                os.pwrite(self._fd, rec.encode(), 0)
            except OSError:                              # an I/O error costs beats, never the run
                pass

    def _run(self):
        while not self._done.wait(self.interval):
            self._beat()

    def stop(self):
        self._done.set()
        with self._lock:                                 # no beat after this (a late one would re-create
            fd, self._fd = self._fd, None                # nothing: the descriptor is closed first)
        if fd is not None:
            os.close(fd)
        try:
            self.path.unlink()
        except OSError:
            pass


def read_heartbeat(path):
    """(pid, host, count) from a heartbeat file, or None while it is being replaced or is garbled."""
    try:
        pid, host, count = Path(path).read_text().split()
        return int(pid), host, int(count)
    except (OSError, ValueError):
        return None


class StopRequest:
    """SIGTERM, SIGINT and SIGUSR1 (Slurm's ``--signal=USR1@120``) ask the run to stop at the end
    of the current step: the handler only records the first signal (a second one -- during the
    save, say -- changes nothing). The trainer passes ``pending`` into the step, whose one world
    allreduce carries it, so every rank learns that some rank was asked, at the same step, and
    they save and stop together. ``install()`` replaces the handlers; ``restore()`` puts back the
    previous ones (the trainer does at a normal end); ``ignore_further()``, after a stop on request,
    makes a repeated signal change nothing until the process has exited with status 75."""

    def __init__(self):
        self.signum, self._old = 0, {}

    @property
    def pending(self) -> bool:
        return self.signum != 0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame):
        if not self.signum:
            self.signum = signum

    def install(self):
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def ignore_further(self):
        """After a stop on request, on the way out: the stop signals ignored until the process ends. A
        Python handler would not last (the interpreter's finalization puts back the default action, and
        MPI_Finalize can wait there for the other ranks); an ignored signal stays ignored."""
        for sig in self._old:
            signal.signal(sig, signal.SIG_IGN)


class NonFiniteStop(RuntimeError):
    """Too many consecutive steps with non-finite loss or gradients."""


# --- naming the first non-finite gradient -------------------------------------------------
def first_nonfinite_grad(named_grads):
    """The name of the first (name, gradient array) pair holding inf or nan, else None."""
    for name, g in named_grads:
        if g is not None and not bool(xp_of(g).isfinite(g).all()):
            return name
    return None


def agree_first_bad(comm, named_grads, width=240):
    """Collective: (rank, name) of the lowest rank's first non-finite gradient, or None everywhere."""
    name = first_nonfinite_grad(named_grads)
    rec = np.zeros(width, np.uint8)
    if name is not None:
        b = name.encode()[:width - 1]
        rec[0] = 1
        rec[1:1 + len(b)] = np.frombuffer(b, np.uint8)
    allrec = comm.allgather(rec.reshape(1, -1)) if comm.size > 1 else rec.reshape(1, -1)
    for r, row in enumerate(np.asarray(allrec).reshape(comm.size, width)):
        if row[0]:
            return r, row[1:].tobytes().rstrip(b"\0").decode()
    return None


class BadStepGuard:
    """Counts consecutive bad (skipped) steps; raises NonFiniteStop past the limit."""

    def __init__(self, max_bad_steps: int, scaler=None):
        self.max_bad, self.scaler = max_bad_steps, scaler
        self.consecutive = 0
        self.first = None          # (step, rank, name) of the first bad step of the current run

    def after_step(self, step, res, comm, named_grads) -> dict:
        """Call on every rank after train_step (res: its StepStats); returns fields for the metrics record.
        named_grads: (name, synced gradient this rank holds), e.g. GradSync.named_grads()."""
        if not res.nonfinite:
            self.consecutive, self.first = 0, None
            return {}
        found = agree_first_bad(comm, named_grads)
        where = f"parameter {found[1]}" if found else "the loss (every gradient was finite)"
        at_floor = self.scaler is None or res.loss_scale <= self.scaler.min_scale
        if at_floor:
            self.consecutive += 1
            if self.first is None:
                self.first = (step, where)
        if self.max_bad and self.consecutive >= self.max_bad:
            s0, w0 = self.first
            raise NonFiniteStop(f"{self.consecutive} consecutive steps with non-finite loss or gradients "
                                f"(steps {s0}..{step}); the first non-finite gradient at step {s0} was in {w0}. "
                                f"No update was applied; the last checkpoint holds finite weights "
                                f"(--max-bad-steps {self.max_bad})")
        return {"nonfinite": True, "first_nonfinite": where, "bad_steps": self.consecutive}

    def state_dict(self):
        return {"consecutive": self.consecutive}

    def load_state_dict(self, d):
        self.consecutive = int(d.get("consecutive", 0))


# --- checkpoints of a run -------------------------------------------------------------------
def checkpoint_root(run) -> Path | None:
    return Path(run.out) / "checkpoints" if run.out else None


def resolve_resume(run, warn=None):
    """Before any collective: the checkpoint to resume from (a Path), or None to start fresh.

    --resume auto: the latest checkpoint under OUT/checkpoints if there is one (its ``latest``
    pointer); where the pointer is missing or damaged but step_N checkpoints are there, the newest
    of them, with ``warn(message)``; a fresh start only where the folder holds no checkpoint at all
    (never over the checkpoints of a run it could not read: ValueError). --resume DIR: DIR must be
    a run directory (another run's --out), its checkpoints/ folder or one step_N checkpoint
    (checkpoint.resolve); raises ValueError naming what was looked for otherwise."""
    from .checkpoint import CheckpointError, resolve
    from .checkpoint import layout_io as L

    if not run.resume:
        return None
    if run.resume == "auto":
        root = checkpoint_root(run)
        if root is None or not root.is_dir():
            return None
        try:
            return resolve(root)
        except CheckpointError as e:
            found = [q for _, q in L.list_steps(root) if L.inside(q, root)]
            if found:
                if warn is not None:
                    warn(f"--resume auto: {e}; resuming from the newest checkpoint there, {found[-1]}")
                return found[-1]
            if not (root / L.LATEST).exists() and not any(q.name.startswith("step_") for q in root.iterdir()):
                return None                    # nothing saved yet: a fresh start
            raise ValueError(f"--resume auto: {e}; and no step_N folder of {root} holds a checkpoint. Move "
                             f"{root} away to start over, or name a checkpoint with --resume") from None
    try:
        return resolve(run.resume)
    except CheckpointError as e:
        raise ValueError(f"--resume {run.resume}: {e.problem}") from None


def check_resumable(path, model_cfg, steps=None) -> None:
    """Before any collective: the checkpoint's manifest reads and holds this model (same shapes
    and function, checkpoint.state.ARCH_KEYS), and the trainer's fields in it are what a save writes
    (a step within --steps, integers where integers go); ValueError naming the file and the field."""
    from .checkpoint import Checkpoint, CheckpointError
    from .checkpoint.state import ARCH_KEYS

    try:
        ck = Checkpoint(path, verify=False)
        if not isinstance(ck.meta.get("config", {}), dict):
            raise ValueError(f"{ck.path}/manifest.json: field 'meta.config': expected an object")
        cfg = asdict(model_cfg)
        ck.check_config({k: cfg[k] for k in ARCH_KEYS if k in cfg})
    except CheckpointError as e:
        raise ValueError(f"--resume: {e}") from None
    mf = f"{ck.path}/manifest.json"
    nxt = ck.meta.get("next_step", ck.step)
    if not isinstance(nxt, int) or isinstance(nxt, bool) or nxt < 0:
        raise ValueError(f"--resume: {mf}: field 'meta.next_step': expected an integer >= 0")
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    opt = ck.meta.get("optimizer", {})
    if not isinstance(opt, dict) or not count(opt.get("step", 0)):
        raise ValueError(f"--resume: {mf}: field 'meta.optimizer.step': expected an integer >= 0")
    guard = ck.meta.get("guard") or {}
    if not isinstance(guard, dict) or not count(guard.get("consecutive", 0)):
        raise ValueError(f"--resume: {mf}: field 'meta.guard': expected {{\"consecutive\": an integer >= 0}}")
    scaler = ck.meta.get("loss_scaler")
    if scaler and not (isinstance(scaler, dict) and count(scaler.get("good_steps"))
                       and isinstance(scaler.get("scale"), (int, float)) and not isinstance(scaler["scale"], bool)
                       and 0 < scaler["scale"] < float("inf")):
        raise ValueError(f"--resume: {mf}: field 'meta.loss_scaler': expected {{\"scale\": a finite number > 0, "
                         f"\"good_steps\": an integer >= 0}}")
    if steps is not None and nxt > steps:
        raise ValueError(f"--resume: {mf}: the checkpoint continues at step {nxt}, beyond --steps {steps}: "
                         f"nothing to train (give --steps above {nxt}, or another checkpoint)")


def first_non_finite(model):
    """The name of the first parameter of ``model`` holding a NaN or an infinity, or None."""
    return next((name for name, p in model.named_parameters() if not bool(xp_of(p.data).isfinite(p.data).all())), None)


def save_run(runner, run, next_step, guard, comm, layout, background=False, staging=None):
    """Collective: checkpoint OUT/checkpoints/step_<next_step> (the weights after next_step steps).
    background: copy the state to host memory (into ``staging``, the caller's {key: buffer} kept
    from one save to the next) and write it on a thread; returns the started
    checkpoint.saving.PendingSave (finish() it, collectively, to publish it)."""
    from .checkpoint import save_training

    model, opt = runner.model, runner.opt
    # never write a non-finite number. The ranks hold different parameters (pipeline stages,
    # tensor shards): they agree first, or the clean ranks would wait in the save's collectives
    # while the others stop (and sit in the exit's teardown)
    bad = first_non_finite(model)
    n_bad = np.array([0.0 if bad is None else 1.0])
    if comm is not None and comm.size > 1:
        out = comm.allreduce(n_bad)
        n_bad = n_bad if out is None else np.asarray(out).reshape(-1)
    if n_bad[0]:
        where = f"parameter {bad}" if bad else f"a parameter of {int(n_bad[0])} other rank(s)"
        raise NonFiniteStop(f"{where} holds non-finite values at step {next_step}; not saving")
    scaler = getattr(runner, "scaler", None)
    meta = {"next_step": int(next_step), "seed": run.seed, "layout": asdict(layout) if is_dataclass(layout) else str(layout),
            "loss_scaler": scaler.state_dict() if scaler else None, "guard": guard.state_dict(),
            "data": {"seed": run.seed, "next_step": int(next_step)}}
    rep = runner.replica_state()
    if rep is not None:
        meta["replicas"] = rep
    return save_training(checkpoint_root(run), next_step, model, opt, comm, meta=meta, keep=run.keep or None,
                         background=background, staging=staging)


def restore_run(runner, path, guard, comm) -> int:
    """Collective: load checkpoint ``path`` into the runner; returns the step to continue from."""
    from .checkpoint import restore_into

    manifest = restore_into(runner.model, runner.opt, path, comm)
    meta = manifest.get("meta", {})
    scaler = getattr(runner, "scaler", None)
    if scaler is not None and meta.get("loss_scaler"):
        scaler.load_state_dict(meta["loss_scaler"])
    guard.load_state_dict(meta.get("guard") or {})
    runner.load_replica_state(meta.get("replicas"))
    return int(meta.get("next_step", manifest.get("step", 0)))
