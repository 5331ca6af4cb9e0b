"""Context parallelism: memory and step time of long sequences at cp = 1, 2, 4.

    python bench/context_parallel.py            # T = 4096 and 8192 (a few minutes on 2 cores)
    python bench/context_parallel.py --quick    # T = 512 (seconds; the smoke test)

A 2-layer, 128-wide GPT (4 heads, vocabulary 256), micro-batch 1, float32, AdamW. Each row is one
mpiexec launch of cp ranks (dp = 1) running this file's worker: STEPS optimizer steps of the same
sequences through ``ParallelRunner`` (the trainer's runner), each rank wrapped in
``/usr/bin/time -f %M`` (its peak resident memory as the kernel counts it, read after it exits).
Per row:
- peak RSS per rank (max over ranks), and the same less the process baseline (a rank of this
  worker with T = 64: interpreter, NumPy, MPI);
- the ledger's activations (bytes the forward kept for backward, measured by the runner) per rank;
- step time: the median over the steps after the first;
- the ring: seconds per step waiting for key/value transfers (what computation did not hide),
  and the time the same transfers take with nothing to overlap (the worker sends the step's
  blocks around the ring alone, after training). A wait also holds
  the time a rank waits for a slower partner to reach the exchange: the per-rank seconds of
  block computation are recorded (attention_busy_s), and hidden = 1 - max(0, waited - their
  spread) / alone (``hidden_fraction``, an estimate).
Threads: every rank gets the node's cores divided by its ranks (the trainer's default), so
cp = 1 runs 2 threads, cp = 2 one per rank, cp = 4 oversubscribes (2 ranks per core); one more
cp = 1 row runs one thread (what cp = 2 buys when each rank brings its own core).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, env, machine, pyplot, run_and_write, save  # noqa: E402
from common import run_with_peaks  # noqa: E402

MODEL = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=256)
STEPS = 4
MiB = 2 ** 20


def worker(T: int, out: str, threads: int = 0):
    """One rank: STEPS steps at block_size T over every rank of the world as one cp group
    (threads: 0 = the node's cores over its ranks)."""
    import numpy as np
    from mpi4py import MPI

    from pympar.comm import MPIComm
    from pympar.nn.config import GPTConfig
    from pympar.config import RunConfig
    from pympar.layout import Layout
    from pympar.optim import OptimConfig
    from pympar.parallel.cores import share_cores
    from pympar.parallel.runner import ParallelRunner
    from pympar.config import apply_environment
    apply_environment()

    mpi = MPI.COMM_WORLD
    cp = mpi.Get_size()
    threads, _ = share_cores(mpi, threads, "--threads")    # 0: the node's cores over its ranks
    cfg = GPTConfig(block_size=T, **MODEL)
    comm = MPIComm(mpi, name="world", timeout=600)
    runner = ParallelRunner(cfg, Layout(cp=cp), comm, RunConfig(seed=1, bucket_mb=25, dtype="float32"),
                            OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0))
    rng = np.random.default_rng(0)
    times, waits, busy, losses = [], [], [], []
    for s in range(STEPS):
        t = rng.integers(0, cfg.vocab_size, size=(1, T + 1))
        mpi.Barrier()
        t0 = time.perf_counter()
        res = runner.train_step([(t[:, :-1], t[:, 1:])], 1e-3)
        times.append(time.perf_counter() - t0)
        waits.append(res.cp_ring["wait_s"])
        busy.append(res.cp_ring["busy_s"])
        losses.append(res.loss)
    alone = 0.0
    if cp > 1:                       # the same transfers with nothing to hide them behind
        core = runner.model.cp_cores[0]
        kv = np.zeros((1, T // cp, 2, cfg.n_embd), np.float32)
        reps = 3
        mpi.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            for _layer in range(cfg.n_layer):
                for tag in range(3):           # forward: cp-1 kv hops; backward: cp-1 kv and cp dkv hops
                    hops = cp if tag == 2 else cp - 1
                    for _ in range(hops):
                        _, reqs = core._exchange(kv, 100 + tag)
                        for r in reqs:
                            r.wait()
        alone = (time.perf_counter() - t0) / reps
    led = runner.ledger
    rows = mpi.gather(dict(rank=mpi.Get_rank(), threads=threads, step_s=times, cp_wait_s=waits, cp_busy_s=busy,
                           losses=losses,
                           ring_alone_s=alone, activations=led["activations"], ledger_peak=led["peak"]), root=0)
    if mpi.Get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    for c in runner.mesh.communicators():
        if hasattr(c, "free"):
            c.free()


def _env():
    """The bench environment without its one-thread settings: the worker sets its own threads."""
    e = env()
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYMPAR_NUM_THREADS"):
        e.pop(k, None)
    return e


def one(T: int, cp: int, timeout: float, threads: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.json"
        p, peaks = run_with_peaks(cp, [str(Path(__file__).resolve()), "--worker", str(T), str(out), str(threads)], timeout,
                                 _env())
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"T={T} cp={cp} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        ranks = json.loads(out.read_text())
    step = max(statistics.median(r["step_s"][1:]) for r in ranks)
    wait = max(statistics.median(r["cp_wait_s"][1:]) for r in ranks)
    alone = max(r["ring_alone_s"] for r in ranks)
    busy = [statistics.median(r["cp_busy_s"][1:]) for r in ranks]
    return dict(T=T, cp=cp, threads=ranks[0]["threads"], peak_rss=max(peaks.values()),
                peak_rss_per_rank=[peaks[r] for r in sorted(peaks)], activations=max(r["activations"] for r in ranks),
                step_s=step, cp_wait_s=wait, ring_alone_s=alone, attention_busy_s=busy,
                attention_imbalance_s=max(busy) - min(busy),
                hidden=hidden_fraction(wait, max(busy) - min(busy), alone), losses=ranks[0]["losses"])


def hidden_fraction(wait, imbalance, alone):
    """The share of the ring's transfer time (``alone``) that computation hid: the wait less what a
    rank spends waiting for a slower partner (the spread of the ranks' block computation), over
    the transfer time. An estimate: the two causes of a wait cannot be told apart exactly."""
    if alone <= 0:
        return None
    return 1.0 - min(alone, max(0.0, wait - imbalance)) / alone


def run(a):
    lengths = [512] if a.quick else [4096, 8192]
    _, base_peaks = run_with_peaks(1, [str(Path(__file__).resolve()), "--worker", "64", os.devnull], a.timeout, _env())
    base = max(base_peaks.values())
    rows = []
    for T in lengths:
        for cp, threads in ((1, 0), (1, 1), (2, 0), (4, 0)):
            r = one(T, cp, a.timeout, threads)
            r["rss_over_baseline"] = r["peak_rss"] - base
            rows.append(r)
            print(f"T={T:5d} cp={cp} ({r['threads']} thread(s)/rank): peak RSS {r['peak_rss'] / MiB:7.1f} MiB "
                  f"({r['rss_over_baseline'] / MiB:7.1f} over the baseline), activations {r['activations'] / MiB:6.1f} MiB, "
                  f"step {r['step_s']:.3f} s, ring wait {r['cp_wait_s']:.4f} s of {r['ring_alone_s']:.4f} s alone"
                  + (f" (hidden {r['hidden']:.0%}; attention imbalance {r['attention_imbalance_s']:.4f} s)"
                     if r["hidden"] is not None else ""), flush=True)
    return dict(machine=machine(), model=MODEL, steps=STEPS, baseline_bytes=base, rows=rows, targets=targets(rows))


def targets(rows) -> dict:
    out = {}
    for T in sorted({r["T"] for r in rows}):
        by = {r["cp"]: r for r in rows if r["T"] == T and (r["cp"] > 1 or r["threads"] > 1 or len(rows) < 3)}
        one_core = [r for r in rows if r["T"] == T and r["cp"] == 1 and r["threads"] == 1]
        if 1 in by and 4 in by:
            out[f"T={T}: activations per rank cp=4 / cp=1 (target <= 0.3)"] = by[4]["activations"] / by[1]["activations"]
            out[f"T={T}: peak RSS over the baseline cp=4 / cp=1"] = by[4]["rss_over_baseline"] / by[1]["rss_over_baseline"]
        if 1 in by and 2 in by:
            out[f"T={T}: step time cp=2 / cp=1 on the same 2 cores (target <= 0.65)"] = by[2]["step_s"] / by[1]["step_s"]
        if one_core and 2 in by:
            out[f"T={T}: step time cp=2 (2 cores) / cp=1 on one core"] = by[2]["step_s"] / one_core[0]["step_s"]
    return out


def plot(res, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for T in sorted({r["T"] for r in res["rows"]}):
        rs = sorted((r for r in res["rows"] if r["T"] == T and (r["cp"] > 1 or r["threads"] > 1)), key=lambda r: r["cp"])
        cps = [r["cp"] for r in rs]
        axes[0].plot(cps, [r["activations"] / MiB for r in rs], "o-", label=f"activations, T={T}")
        axes[0].plot(cps, [r["rss_over_baseline"] / MiB for r in rs], "s--", label=f"peak RSS - baseline, T={T}")
        line, = axes[1].plot(cps, [r["step_s"] for r in rs], "o-", label=f"T={T}, the node's 2 cores")
        one = [r for r in res["rows"] if r["T"] == T and r["cp"] == 1 and r["threads"] == 1]
        if one:
            axes[1].plot([1], [one[0]["step_s"]], "x", color=line.get_color(), ms=9, label=f"T={T}, cp=1 on one core")
    axes[0].set(xlabel="cp", ylabel="MiB per rank", title="memory per rank", xticks=[1, 2, 4])
    axes[1].set(xlabel="cp", ylabel="seconds", title="step time (cp=4: 2 ranks per core)", xticks=[1, 2, 4])
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"context parallelism, 2-layer 128-wide GPT, micro-batch 1 ({res['machine']})", fontsize=8)
    save(fig, path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), argv[2], int(argv[3]) if len(argv) > 3 else 0)
        return None
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = 512 only (the smoke test)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    res = run_and_write(ap, argv, "context_parallel", run, plot)
    for k, v in res["targets"].items():
        print(f"{k}: {v:.3f}")
    return res


if __name__ == "__main__":
    main()
