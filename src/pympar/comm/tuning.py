"""algo="auto": the fastest choice for this job's transport and placement, measured.

For each (collective, dtype, size bucket) that a communicator meets with ``algo="auto"``, the
choice comes from, in order:

1. a tuning file (``$PYMPAR_TUNING=FILE``, written by ``python -m pympar.bench <collective>
   --tune FILE``), when it was made on the same kind of machine (CPU model, MPI library) and
   holds entries for this communicator's shape (ranks, nodes, ranks per node). A file for
   another machine or shape is ignored with a :class:`TuningWarning`, never misapplied;
2. otherwise a short measurement, agreed by every rank, the first time the bucket is met:
   each candidate (the MPI library's own call and every pympar algorithm the topology allows)
   runs on the call's own operands a few rounds, interleaved (a round of a small message is a
   burst of up to 8 back-to-back calls); the per-round times are reduced
   with MAX over the ranks (one library allreduce), so every rank holds the same table of
   "slowest rank's time" and takes the same decision from it; per candidate the median over
   rounds counts (a candidate that is only sometimes fast does not win). The contenders
   (within ``CLOSE`` of the fastest) are then timed again, in rounds of at least ``_SPAN``
   seconds (more rounds of one call for a large message), and those times count for them.
   The library's call wins unless another candidate is more than ``MARGIN`` faster.

``$PYMPAR_TUNING=library`` makes auto the library's call everywhere (no measurement).
``$PYMPAR_TUNING=reproducible`` (``python -m pympar.train``'s default) measures only where the
choice cannot change a result: a floating-point reduction (allreduce, reduce_scatter, reduce)
over 3 or more ranks takes the library's call -- its blocking one when the communicator may
use it -- because another algorithm adds the ranks in another order, which rounds differently,
and a measured choice can differ between two jobs (timing noise, a slow minute). Data movement
(allgather, broadcast, alltoall), integer reductions and 2-rank reductions (every algorithm
computes a + b) are measured as usual: every candidate gives the same bits there.

Buckets are powers of two: bucket b holds the messages of (2^(b-1), 2^b] bytes. The nonblocking verbs do not measure: their auto is the library's
nonblocking collective (what overlaps with computation without pympar driving it).
"""
from __future__ import annotations

import errno
import json
import os
import platform
import time
import warnings

import numpy as np

from .settings import SETTINGS
from .verbs import VERBS

FORMAT = "pympar-tuning/2"
MARGIN = 1.05       # another algorithm must beat the library's call by more than 5% to be chosen
_BUDGET = 4 << 20   # measurement rounds: about this many bytes per candidate, 3 to 16 rounds
_ROUND = 1 << 20    # a timed round is a burst of calls of about this many bytes (1 to 8 calls)
CLOSE = 1.5         # candidates measured within this factor of the fastest are timed again ...
_SPAN = 2e-3        # ... in rounds of at least this many seconds (again())


class TuningWarning(UserWarning):
    """A tuning file that does not fit this machine or communicator (it is not used)."""


def bucket(nbytes: int) -> int:
    """Size bucket: the smallest b with 2^b >= nbytes (0 for 0 and 1 byte)."""
    return max(0, int(nbytes) - 1).bit_length()


def batch(nbytes: int) -> int:
    """Calls per timed round: up to 8 back-to-back calls, about _ROUND bytes. A lone call's time
    is mostly how far apart the ranks entered it (the previous candidate's exit, the scheduler),
    which a burst spreads over its calls: measured at 3 ranks on 2 cores, 64 KiB, a lone library
    call timed 189 us against 60-72 us a call in a loop, and the measurement chose pympar's shm
    (1.6-1.9x slower in the loop); timed in bursts of 4 it chose the library's call."""
    return int(min(8, max(1, _ROUND // max(int(nbytes), 1))))


def rounds(nbytes: int) -> int:
    """Timed rounds per candidate: 3 to 16 (5 when batched), about _BUDGET bytes in all (at
    least 3: a median of 2 is their mean, and one slow round of a large message decides it).
    A bucket costs about candidates x (1 + rounds) x batch calls and candidates x rounds barriers,
    once per communicator."""
    b = batch(nbytes)
    return int(min(5 if b > 1 else 16, max(3, _BUDGET // max(int(nbytes) * b, 1))))


def shape_key(size: int, n_nodes: int, max_node_size: int, uniform: bool) -> str:
    """A communicator's shape as tuning files name it, e.g. '4r-2n-2rpn'."""
    return f"{size}r-{n_nodes}n-{max_node_size}rpn" + ("" if uniform else "-uneven")


def machine() -> dict:
    """What a tuning file must have been measured on: the CPU model and the MPI library."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from mpi4py import MPI

    lib = MPI.Get_library_version().strip().splitlines()[0].strip()
    return {"cpu": cpu, "mpi": " ".join(lib.split())}


class Decision:
    """What auto runs for one (collective, dtype, bucket) on one communicator, and why.

    source: 'file' (tuning file), 'measured' (this job's agreed measurement), 'library'
    ($PYMPAR_TUNING=library), 'reproducible' (a floating-point reduction over 3+ ranks under
    $PYMPAR_TUNING=reproducible), 'only' (one candidate) or 'mismatch' (the ranks were not in the
    same call: the library's call ran, nothing was decided); times_us: candidate -> the slowest
    rank's time (median over rounds) behind the choice, empty when nothing was measured."""

    __slots__ = ("collective", "dtype", "nbytes", "bucket", "shape", "algo", "source", "times_us")

    def __init__(self, collective, dtype, nbytes, shape, algo, source, times_us=None):
        self.collective, self.dtype, self.nbytes = collective, str(dtype), int(nbytes)
        self.bucket, self.shape, self.algo, self.source = bucket(nbytes), shape, algo, source
        self.times_us = dict(times_us or {})

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __str__(self):
        lo, hi = (1 << (self.bucket - 1)) + 1 if self.bucket else 0, 1 << self.bucket
        head = (f"{self.collective} {self.dtype} {self.nbytes} B (bucket {lo}..{hi} B) on {self.shape}: "
                f"auto -> {self.algo} ({self.source})")
        if not self.times_us:
            return head
        best = min(self.times_us.values())
        rows = "".join(f"\n  {a:>20} {t:12.1f} us  {t / best if best > 0 else 1.0:6.2f}x"
                       + ("  <- chosen" if a == self.algo else "")
                       for a, t in sorted(self.times_us.items(), key=lambda kv: kv[1]))
        return head + rows


def pick(times: dict, library: str | None = None) -> str:
    """The candidate to run from {name: seconds}: the library unless beaten by > MARGIN. The
    library's call is its blocking one where it is a candidate (on_timeout="abort"), else its
    nonblocking one ("mpi"): the plain call, the one that waits best when ranks outnumber cores,
    where a burst of back-to-back calls can make a polled one look faster than it runs."""
    if library is None:
        library = "blocking" if "blocking" in times else "mpi"
    best = min(times, key=lambda a: (times[a], a != library, a))
    if library in times and times[library] <= MARGIN * times[best]:
        return library
    return best


def measure(names, runs, coll, nbytes, timer=None, waiter=None) -> dict:
    """{name: seconds}: the median over rounds of the slowest rank's time of runs[name]().

    Collective over the mpi4py communicator ``coll`` (every rank calls it with the same
    names in the same order). runs[name]() performs one complete collective of nbytes; a round times
    batch(nbytes) of them back to back, after a barrier, timer(name, run) -> seconds of one round (default:
    perf_counter around run()), divided by the batch. The rounds' times are MAX-reduced over
    the ranks, so the result -- and any decision taken from it -- is the same on every rank
    even when the ranks' own clocks disagree. Then the contenders (within CLOSE of the fastest)
    are timed again (contenders()): rounds of again(fastest, batch) calls, whose times replace the
    first ones, or, where that is the same batch (a first round already lasts _SPAN), more rounds
    of it, whose median is taken with the first ones; the others keep their first times (more than
    CLOSE slower than a contender's first time: pick() takes one of them only if every contender's
    second time came out slower still). waiter: the call's progress.Waiter, under whose deadline
    the barriers and the reductions of the times wait, renewed before each round: the
    communicator's timeout bounds each round, not the whole measurement (at 8 ranks on 2 cores a
    64 MiB bucket takes about 8 s); None: the library's blocking calls."""
    timer = timer or _time_it
    reps, k = rounds(nbytes), batch(nbytes)
    burst = {name: _burst(runs[name], k) for name in names}
    for name in names:           # warm-up, a burst: first-use allocations (shared windows, buffers)
        _renew(waiter)           # and the library's first calls of a kind, slower than the rest
        burst[name]()
    t = _timed(names, burst, coll, reps, k, timer, waiter)
    times = {name: float(np.median(t[:, j])) for j, name in enumerate(names)}
    close = contenders(times)
    if len(close) > 1:
        k2 = again(min(times.values()), k)
        if k2 != k:
            burst = {name: _burst(runs[name], k2) for name in close}
        t2 = _timed(close, burst, coll, reps, k2, timer, waiter)
        for j, name in enumerate(close):
            both = t2[:, j] if k2 != k else np.concatenate([t[:, names.index(name)], t2[:, j]])
            times[name] = float(np.median(both))
    return times


def contenders(times: dict) -> list:
    """The candidates measured within CLOSE of the fastest, in their order: timed again."""
    best = min(times.values())
    return [name for name, s in times.items() if s <= CLOSE * best]


def again(fastest: float, k: int) -> int:
    """Calls per round when the contenders are timed again: rounds of at least _SPAN seconds at
    the fastest one's time (at most 256 calls, never fewer than the first rounds' k). A burst of 8
    calls of a few microseconds is mostly how far apart a barrier lets the ranks go (a scheduler's
    slice where ranks outnumber cores): measured at 4 ranks on two cliques, 16 B, the library's
    polled and blocking calls timed 18 and 18 us a call in bursts of 8, 11 and 14 us in a loop."""
    if fastest <= 0:
        return k
    return int(max(k, min(256, np.ceil(_SPAN / fastest))))


def _timed(names, burst, coll, reps, k, timer, waiter):
    """reps x len(names) seconds a call: each round a burst per name after a barrier, interleaved
    over the names; MAX-reduced over the ranks."""
    from mpi4py import MPI

    def done(req):
        if waiter is None:
            req.Wait()
        else:
            waiter.wait([req], [None])
    t = np.zeros((reps, len(names)))
    for i in range(reps):
        for j, name in enumerate(names):
            _renew(waiter)           # the timeout bounds a round (its barrier and burst), not the measurement
            done(coll.Ibarrier())    # every burst starts with the ranks together, whoever ran before it
            t[i, j] = timer(name, burst[name]) / k
    _renew(waiter)
    done(coll.Iallreduce(MPI.IN_PLACE, t, MPI.MAX))
    return t


def _renew(waiter):
    if waiter is not None:
        waiter.renew()


def _burst(run, k):
    if k == 1:
        return run

    def go():
        for _ in range(k):
            run()
    return go


def _time_it(_name, run):
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


# --- tuning files ----------------------------------------------------------------------
def read_setting(value=None):
    """The tuning setting (pympar.comm.settings; or value): None (measure), 'library', or the
    parsed file as a dict.

    Called on one rank (MPIComm broadcasts the result). A file that cannot be read or is not
    a tuning file of this format gives a TuningWarning and None."""
    value = SETTINGS.tuning if value is None else value
    value = str(value).strip()
    if value in ("", "measure", "auto"):
        return None
    if value in ("library", "reproducible"):
        return value
    try:
        if not os.path.isfile(value):           # a pipe or a device could block the job's start
            raise OSError(errno.EINVAL, "not a regular file" if os.path.exists(value) else "no such file")
        with open(value) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        warnings.warn(f"PYMPAR_TUNING={value!r}: cannot read the tuning file ({e}); measuring instead",
                      TuningWarning, stacklevel=2)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not _well_formed(data):
        warnings.warn(f"PYMPAR_TUNING={value!r} is not a {FORMAT} tuning file (write one with "
                      f"`python -m pympar.bench allreduce --tune FILE`); measuring instead",
                      TuningWarning, stacklevel=2)
        return None
    data["path"] = value
    return data


def _well_formed(data: dict) -> bool:
    """The file's tree as write_file makes it: machine {str: str}; shapes {shape: {verb: {dtype:
    {bucket: {"algo": str, "times_us": {algo: number}?}}}}}."""
    def strs(d):
        return isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())

    def entry(e):
        t = e.get("times_us", {}) if isinstance(e, dict) else None
        return isinstance(e, dict) and isinstance(e.get("algo"), str) and isinstance(t, dict) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in t.values())

    shapes = data.get("shapes", {})
    return strs(data.get("machine", {})) and isinstance(shapes, dict) and all(
        isinstance(verbs, dict) and all(
            isinstance(dtypes, dict) and all(
                isinstance(buckets, dict) and all(entry(e) for e in buckets.values())
                for buckets in dtypes.values())
            for dtypes in verbs.values())
        for verbs in shapes.values())


_SHARED = {}   # (members, setting, on_timeout) -> decisions: one cache per group of ranks


class Tuner:
    """One communicator's auto decisions: a cache over the tuning file and measurements.

    members: the communicator's ranks as COMM_WORLD ranks, in its order. Communicators of the
    same members (and the same setting and timeout mode) share one cache in the process: a
    decision was measured collectively by all of those ranks, so each of them holds it, and a
    job that makes the same groups again (a mesh per layout, sub-communicators per step) does
    not measure them again."""

    def __init__(self, setting, shape: str, comm_name: str, warn: bool, members=None, on_timeout="raise"):
        self.size = int(shape.split("r", 1)[0])   # the shape key starts with the ranks: '4r-...'
        self.mode = setting if setting in ("library", "reproducible") else "measure"
        self.shape, self.comm_name = shape, comm_name
        where = setting.get("path") if isinstance(setting, dict) else setting
        self.decisions = {} if members is None else _SHARED.setdefault((tuple(members), where, on_timeout), {})
        self.entries = None
        if isinstance(setting, dict):
            self.entries = self._fit(setting, warn)

    def _fit(self, data, warn):
        path, here, there = data.get("path", "?"), machine(), data.get("machine", {})
        if there != here:
            if warn:
                warnings.warn(f"tuning file {path} was measured on {there.get('cpu')!r} with {there.get('mpi')!r}, "
                              f"this is {here['cpu']!r} with {here['mpi']!r}: ignored, measuring instead "
                              f"(write one here with `python -m pympar.bench allreduce --tune FILE`)",
                              TuningWarning, stacklevel=4)
            return None
        shapes = data.get("shapes", {})
        if self.shape not in shapes:
            if warn:
                warnings.warn(f"tuning file {path} has no entries for communicator {self.comm_name!r} of shape "
                              f"{self.shape} (ranks-nodes-ranks per node; it has {sorted(shapes) or 'none'}): "
                              f"ignored for it, measuring instead (run `mpiexec -n N python -m pympar.bench "
                              f"<collective> --tune {path}` at this shape to add them)", TuningWarning, stacklevel=4)
            return None
        return shapes[self.shape]

    def order_sensitive(self, verb, dtype) -> bool:
        """Whether two algorithms may give ``verb`` different bits here: a reduction of a
        non-integer dtype over 3 or more ranks (the ranks' terms added in another order)."""
        return VERBS[verb].reducing and self.size >= 3 and np.dtype(dtype).kind not in "iub"

    def lookup(self, verb, dtype, nbytes, candidates):
        """The cached or filed decision, or None when it must be measured."""
        key = (verb, str(dtype), bucket(nbytes))
        d = self.decisions.get(key)
        if d is not None:
            return d
        if len(candidates) == 1 or self.mode == "library":
            d = Decision(verb, dtype, nbytes, self.shape, "mpi", "only" if len(candidates) == 1 else "library")
        elif self.mode == "reproducible" and self.order_sensitive(verb, dtype):
            d = Decision(verb, dtype, nbytes, self.shape, "blocking" if "blocking" in candidates else "mpi",
                         "reproducible")
        elif self.entries is not None:
            e = self.entries.get(verb, {}).get(str(dtype), {}).get(str(bucket(nbytes)))
            if e is not None and e.get("algo") in candidates:
                d = Decision(verb, dtype, nbytes, self.shape, e["algo"], "file", e.get("times_us"))
        if d is not None:
            self.decisions[key] = d
        return d

    def record(self, verb, dtype, nbytes, times):
        d = Decision(verb, dtype, nbytes, self.shape, pick(times), "measured",
                     {a: t * 1e6 for a, t in times.items()})
        self.decisions[(verb, str(dtype), bucket(nbytes))] = d
        return d


def check_target(path) -> None:
    """ValueError unless write_file may write ``path``: a new file, or a pympar tuning file (of any
    machine or format version, which write_file replaces); anything else is someone's data."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory; give a file name")
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            fmt = json.load(f).get("format", "")
    except (OSError, ValueError, AttributeError):
        fmt = ""
    if not str(fmt).startswith("pympar-tuning/"):
        raise ValueError(f"{path} exists and is not a pympar tuning file; it would be replaced: give a new file name")


def write_file(path, shape, verb, dtype, rows):
    """Add {nbytes: {candidate: seconds}} measured at ``shape`` to the tuning file ``path``.

    Each size's decision uses the same rule as the measurement (pick). Entries of other
    shapes, collectives and dtypes already in the file stay; a tuning file of another machine or
    format version is replaced (with a TuningWarning); any other file is refused (check_target)."""
    check_target(path)
    here, data = machine(), None
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError):
            data = None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("machine") != here \
                or not _well_formed(data):
            warnings.warn(f"{path} is not a {FORMAT} tuning file of this machine: replaced", TuningWarning, stacklevel=2)
            data = None
    data = data or {"format": FORMAT, "machine": here, "shapes": {}}
    table = data["shapes"].setdefault(shape, {}).setdefault(verb, {}).setdefault(str(dtype), {})
    for nbytes, times in sorted(rows.items()):
        table[str(bucket(nbytes))] = {"nbytes": int(nbytes), "algo": pick(times),
                                      "times_us": {a: round(t * 1e6, 3) for a, t in times.items()}}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return data
