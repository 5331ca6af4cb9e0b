"""Training metrics: model FLOPs, the measured matmul peak, MFU, MoE load statistics, JSONL.

Model FLOPs per token (forward + backward = 3 x forward, a matmul of K x N costs 2KN per
token forward):

    flops_per_token = 6 * N_matmul + 12 * n_layer * block_size * n_embd

    N_matmul = sum over blocks of the weights a token passes through
               attention: 4 C^2 (qkv 3C^2 + output C^2)
               dense MLP: 8 C^2 (C -> 4C -> C)
               MoE MLP:   top_k * 8 C^2  (+ 8 C^2 shared expert) + C * n_expert (router)
             + V * C (the tied lm_head; the embedding lookups are not matmuls)

The second term is attention's two matmuls (Q K^T and A V: 2 * 2 * T * C per token and
layer forward, times 3), counted over the full T x T square as in the PaLM paper and
nanoGPT (no discount for the causal mask). Only the experts a token is routed to count,
so MoE MFU reflects active parameters. Biases and LayerNorms are left out.

MFU = tokens_per_s * flops_per_token / (peak_flops_per_rank * world_size), where the peak
is measured at start-up on each process (``measure_matmul_peak``). The count itself is
``pympar.nn.config.flops_per_token`` (a function of the model alone).
"""
from __future__ import annotations

import errno
import json
import os
import stat
import time

import numpy as np


def measure_matmul_peak(xp=np, dtype=np.float32, n: int = 256, seconds: float = 0.3, barrier=None) -> float:
    """FLOP/s this process achieves multiplying n x n matrices for ``seconds`` of wall time.

    Pass the job's barrier so that every rank measures in the same window: the sum over
    ranks is then what the machine gives the job when all its ranks compute at once.
    """
    if xp is not np:
        n = max(n, 4096)
    from .nn.products import matmul# the library the model's products run on (kernels/gemm.py)
    a = xp.ones((n, n), dtype=dtype)
    out = xp.empty_like(a)
    sync = (lambda: xp.cuda.Device().synchronize()) if xp is not np else (lambda: None)
    matmul(a, a, out=out)  # warm-up
    sync()
    if barrier is not None:
        barrier()
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        matmul(a, a, out=out)
        reps += 1
    sync()
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


def measure_cpu_peak(dtype: str, seconds: float = 0.3, barrier=None) -> float:
    """The CPU matmul peak in the dtype a run computes in (bf16 products on the bf16 engine run at
    about twice float32's rate: a float32 burst would rate a bf16 step's products too slow)."""
    if dtype == "bfloat16":
        from . import backend
        return measure_matmul_peak(dtype=backend.dtype("bfloat16"), n=512, seconds=seconds, barrier=barrier)
    return measure_matmul_peak(seconds=seconds, barrier=barrier)


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory from /proc/self/status, 0 where there is none.

    field: VmRSS (all resident pages) or RssAnon (heap and anonymous maps only: without the
    file pages of a memory-mapped corpus, which grow as training reads more of the file)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024          # "VmRSS:   123456 kB"
    except OSError:
        pass
    return 0


def process_ancestors(pid: int, levels: int = 16):
    """(pid, command name) of pid and its parents, from /proc, up to ``levels`` of them; stops early
    at init or where /proc cannot be read (another user's process, a system without /proc)."""
    for _ in range(levels):
        if pid <= 1:
            return
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            yield pid, name
            pid = int(rest[1])
        except (OSError, ValueError, IndexError):
            return


def moe_layer_stats(tokens_per_expert) -> dict:
    """Load statistics of one MoE layer from its per-expert token counts."""
    t = np.asarray(tokens_per_expert, dtype=np.float64)
    mean = t.mean() if t.size else 0.0
    return {
        "tokens_per_expert": [int(v) for v in t],
        "load_cv": float(t.std() / mean) if mean > 0 else 0.0,
        "max_over_mean": float(t.max() / mean) if mean > 0 else 0.0,
    }


def read_records(path) -> tuple:
    """The records of a metrics.jsonl (one JSON object per line) up to the first line that is not
    one, and that line's trouble: (rows, None) when every line was read, else (rows, (line number,
    what is wrong, cut)) -- cut: it is the last line and has no newline, what a run killed while
    writing leaves. Undecodable bytes are read as U+FFFD (a line they break is a damaged line; inside a
    JSON string they stay replaced). OSError (missing, unreadable, a directory, a pipe: never opened,
    it could block forever) is the caller's."""
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    rows = []
    for n, (i, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError as e:
            cut = n == len(lines) - 1 and not line.endswith("\n")
            return rows, (i, "is cut short (a killed run?)" if cut else f"is not JSON ({e})", cut)
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
            return rows, (i, "is not a record of a step (a JSON object with an integer \"step\")", False)
        rows.append(row)
    return rows, None


class MetricsWriter:
    """Appends one JSON object per line to a file (or does nothing when path is None). A write the
    disk refuses (full, gone) costs the log, not the run: one warning on stderr, and the records stop;
    the training goes on (its checkpoints say for themselves whether they could be written)."""

    def __init__(self, path):
        self.path = path
        self.f = None
        try:
            if path and os.path.islink(path):       # replaced, not written through: the run writes in --out only
                os.unlink(path)
            if path and os.path.isdir(path):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
            if path and os.path.exists(path) and stat.S_ISFIFO(os.stat(path).st_mode):    # would block the run
                raise OSError(errno.EINVAL, "a named pipe, not a file", str(path))
            if path:                                # O_NOFOLLOW: a link planted again meanwhile is refused
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
                self.f = os.fdopen(fd, "w")
        except OSError as e:
            self._give_up(e)

    def write(self, record: dict) -> None:
        if not self.f:
            return
        try:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()
        except OSError as e:
            self._give_up(e)

    def _give_up(self, e: OSError) -> None:
        import sys
        sys.stderr.write(f"pympar.train: warning: cannot write {self.path} ({e.strerror or e}); "
                         f"no more metrics records this run\n")
        sys.stderr.flush()
        try:
            if self.f:
                self.f.close()
        except OSError:
            pass
        self.f = None

    def close(self) -> None:
        if self.f:
            try:
                self.f.close()
            except OSError as e:
                self._give_up(e)
