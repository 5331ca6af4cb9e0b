"""Launch real MPI jobs from the tests: ``mpiexec -n N python ...`` with a hard timeout.

A hung collective must fail the test in seconds, not eat CI's time: on timeout the whole
process group of the launcher is killed and the test fails with the tail of its output.
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise RuntimeError("no mpiexec on PATH: pip install 'pympar[mpich]' (the MPICH wheel) or load your MPI")
    return found


def mpi_env(extra=None):
    env = dict(os.environ)
    # many ranks on 2 cores: one thread per rank
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PYMPAR_NUM_THREADS"):
        env[k] = "1"
    env.setdefault("PYTHONHASHSEED", "0")
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in (extra or {}).items():          # None: the variable is removed
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def _abs(a) -> str:
    """Script paths given relative to the repository root, made absolute."""
    a = str(a)
    if not a.startswith("-") and a.endswith(".py") and not os.path.isabs(a) and (ROOT / a).exists():
        return str(ROOT / a)
    return a


def _descendants(pid: int) -> list:
    """Every live process below pid (read from /proc): the launcher's ranks may sit in process groups
    of their own, which killing the launcher's group misses -- and a rank left alive keeps the
    output pipe open, so reading it would wait for good."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_job(p):
    """SIGKILL the launcher's process group and every process below it."""
    procs = _descendants(p.pid)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_mpi(n: int, args, timeout: float = 120, env=None, cwd=None, check=True, address_space=None):
    """Run ``mpiexec -n n python <args>``; return CompletedProcess (stdout+stderr merged).
    ``address_space``: bytes of virtual memory each process may map (RLIMIT_AS, as ``ulimit -v``).

    Raises AssertionError naming the command and showing the output tail when it fails
    (check=True) or exceeds ``timeout`` seconds.
    """
    cmd = [mpiexec(), "-n", str(n), sys.executable] + [_abs(a) for a in args]
    if cwd is None:                             # the ranks import the installed pympar (src/ layout:
        cwd = ROOT                               # the checkout's root has no pympar/ to shadow it)
    limit = None if address_space is None else \
        (lambda: resource.setrlimit(resource.RLIMIT_AS, (int(address_space), int(address_space))))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=mpi_env(env), cwd=cwd, start_new_session=True, preexec_fn=limit)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_job(p)
        out, _ = p.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n--- output tail ---\n{out[-4000:]}")
    except BaseException:                       # pytest-timeout, Ctrl-C: the job must not outlive the test
        _kill_job(p)
        p.communicate()
        raise
    res = subprocess.CompletedProcess(cmd, p.returncode, out, "")
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {' '.join(cmd)}\n--- output tail ---\n{out[-6000:]}")
    return res


def run_pytest_mpi(n: int, test_file: str, timeout: float = 180, env=None, extra_args=()):
    """Run a test module of tests/mpi/ on n ranks, each rank a pytest process (mpi4py's style)."""
    args = ["-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", "-o", "addopts=",
            "--timeout", str(int(timeout * 0.8)), str(ROOT / "tests" / "mpi" / test_file), *extra_args]
    res = run_mpi(n, args, timeout=timeout, env=env)
    # a rank whose every test skipped exits 0 but tested nothing (e.g. a missing module)
    partial = False
    for summary in _SUMMARY.findall(res.stdout):
        if "skipped" in summary and "passed" not in summary:
            raise AssertionError(f"every test of {test_file} skipped on a rank at -n {n} ({summary.strip()}): "
                                 f"nothing was tested; the skip reasons are in the output\n"
                                 f"--- output tail ---\n{res.stdout[-4000:]}")
        partial = partial or "skipped" in summary
    if partial:   # some tests skipped at this rank count: say which and why, in the outer run's warnings
        reasons = sorted(set(_SKIPPED.findall(res.stdout)))
        warnings.warn(PartialSkip(f"{test_file} at -n {n}: tests skipped: " + ("; ".join(reasons) or "see -rs output")))
    return res


class PartialSkip(UserWarning):
    """Some tests of an MPI test file skipped at a rank count (shown in pytest's warnings summary)."""


# pytest -rs lines: "SKIPPED [2] tests/mpi/mpi_x.py:41: needs 4 ranks"
_SKIPPED = re.compile(r"SKIPPED \[\d+\] ([^\n]+)")


# one rank's pytest summary, e.g. "3 passed, 1 skipped in 0.52s" (ranks' lines may interleave)
_SUMMARY = re.compile(r"((?:\d+ (?:passed|failed|skipped|xfailed|xpassed|errors?|warnings?|deselected)(?:, )?)+)"
                      r" in [\d.]+s")


# A wrapper that runs a command as its child (with the wrapper's descriptors: an MPI rank's PMI
# connection is one) and prints the child's peak resident memory, VmHWM from getrusage of the
# finished child: the kernel's count, not the test runner's or an earlier child's. One write(2) of
# the whole line (shorter than PIPE_BUF: atomic on the shared pipe), so that two ranks' lines cannot
# interleave (print's pieces, unbuffered under PYTHONUNBUFFERED, did: "PEAK_KIB PEAK_KIB 224432\n 224068").
PEAK_WRAPPER = ("import os, resource, subprocess, sys; r = subprocess.run(sys.argv[1:], close_fds=False); "
                "os.write(1, ('\\nPEAK_KIB %d\\n' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss).encode()); "
                "sys.exit(r.returncode)")


def peaks_kib(text):
    """(the output without the wrappers' lines, [each wrapper's peak in KiB])."""
    kept, peaks = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith("PEAK_KIB "):
            peaks.append(int(line.split()[1]))
        else:
            kept.append(line)
    return "".join(kept), peaks
