"""Data-parallel scaling: step time at dp = 1, 2, 4 with the gradient sync overlapped with
backward or not, the share of the communication hidden behind backward, and (--curves) the
loss curve and bytes per step of the compressed syncs against the dense one.

Weak scaling: every rank runs the same micro-batches per step (the global batch grows with
dp), so ideal scaling keeps the step time flat. Per configuration, median over the timed
steps of rank 0:
  step_s      the whole step (forward+backward of n_micro micro-batches, sync, AdamW)
  exposed_s   time blocked in DataParallel.finish() (the sync not hidden behind backward)
  sync_s      overlap off: the whole sync (everything starts in finish, nothing is hidden)
  hidden      1 - exposed_s(overlap on) / sync_s(overlap off) at the same dp and buckets
  hidden_span DataParallel's own estimate: 1 - exposed / (first bucket start .. end of finish)

On this 2-core machine dp=4 oversubscribes the cores, so absolute times mostly measure
contention; MPI progress of the library's nonblocking allreduce happens only inside the
test/wait calls DataParallel makes between blocks. Read the ratios, not the seconds.

    python bench/dp_scaling.py --launch --dp 1,2,4 --json bench/dp_scaling.json
    python bench/dp_scaling.py --launch --curves --json bench/dp_compress.json
    mpiexec -n 2 python bench/dp_scaling.py --overlap 1 --bucket-mb 1      # one configuration

By default (--overlap 2) each run alternates overlap on and off step by step, so that both
modes see the same machine load (this VM is shared); the medians are per mode.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", action="store_true", help="spawn mpiexec for every dp and overlap setting")
    ap.add_argument("--dp", default="1,2,4")
    ap.add_argument("--overlap", type=int, default=2,
                    help="worker: 1 = start buckets during backward, 0 = all in finish, 2 = alternate per step")
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-micro", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--curves", action="store_true", help="loss curves and bytes of none/fp16/bf16/topk at dp=2")
    ap.add_argument("--compress", default="none", help="worker: compression of the sync")
    ap.add_argument("--curve-steps", type=int, default=60)
    ap.add_argument("--topk", type=float, default=0.01)
    ap.add_argument("--json", default="")
    ap.add_argument("--timeout", type=float, default=600)
    return ap.parse_args(argv)


# --- worker (inside mpiexec) ------------------------------------------------------------------
def worker(a):
    import numpy as np

    from pympar.comm import MPIComm
    from pympar.data import load_corpus, local_micro_batches
    from pympar.nn import GPT, GPTConfig
    from pympar.optim import AdamW
    from pympar.parallel.dp import DataParallel

    comm = MPIComm()
    cfg = GPTConfig.from_preset(a.preset, block_size=a.block_size)
    model = GPT(cfg, seed=0)
    opt = AdamW(model.named_parameters(), lr=1e-3 if not a.curves else 3e-3)
    dp = DataParallel(model.named_parameters(), comm, bucket_mb=a.bucket_mb, overlap=bool(a.overlap),
                      compress=a.compress).attach(model)
    corpus = load_corpus(None)
    steps = a.curve_steps if a.curves else a.warmup + a.steps * (2 if a.overlap == 2 else 1)
    rows = []
    for s in range(steps):
        if a.overlap == 2:           # paired: on and off alternate, so both see the same load
            dp.overlap = s % 2 == 1
        mbs = local_micro_batches(corpus.train, 7, s, comm.rank, a.n_micro, a.micro_batch_size, cfg.block_size)
        comm.barrier()
        t0 = time.perf_counter()
        model.zero_grad()
        dp.begin_step()
        local = 0.0
        for j, (x, y) in enumerate(mbs):
            dp.begin_micro(last=(j == len(mbs) - 1))
            local += model.loss_and_grad(x, y, grad_scale=1.0 / len(mbs)) / len(mbs)
        t_bwd = time.perf_counter()
        dp.finish()
        dp.step(opt, clip=1.0)
        t1 = time.perf_counter()
        loss = float(np.asarray(comm.allreduce(np.array([local]))).reshape(-1)[0]) / comm.size
        st = dp.stats()["last"]
        rows.append(dict(overlap=dp.overlap, step_s=t1 - t0, compute_s=t_bwd - t0, exposed_s=st["exposed_s"], span_s=st["span_s"],
                         bytes_sent=st["bytes_sent"], payload_bytes=st["payload_bytes"], loss=loss))
    if comm.rank != 0:
        return
    if a.curves:
        out = dict(compress=a.compress, dp=comm.size, losses=[r["loss"] for r in rows],
                   bytes_sent=rows[-1]["bytes_sent"], payload_bytes=rows[-1]["payload_bytes"])
    else:
        out = []
        for ov in sorted({r["overlap"] for r in rows[a.warmup:]}):
            timed = [r for r in rows[a.warmup:] if r["overlap"] == ov]
            med = {k: statistics.median(r[k] for r in timed) for k in ("step_s", "compute_s", "exposed_s", "span_s")}
            out.append(dict(dp=comm.size, overlap=ov, bucket_mb=a.bucket_mb, n_buckets=len(dp.buckets),
                            params=int(sum(p.data.size for p in model.parameters())),
                            bytes_sent=timed[-1]["bytes_sent"], steps=len(timed),
                            hidden_span=(1 - med["exposed_s"] / med["span_s"]) if med["span_s"] > 0 else 0.0, **med))
    print("RESULT " + json.dumps(out), flush=True)


# --- launcher -------------------------------------------------------------------------------
def run_one(a, n, extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYMPAR_NUM_THREADS="1")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    args = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(n), sys.executable, __file__,
            "--preset", a.preset, "--micro-batch-size", str(a.micro_batch_size), "--block-size", str(a.block_size),
            "--n-micro", str(a.n_micro), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--bucket-mb", str(a.bucket_mb), "--curve-steps", str(a.curve_steps), "--overlap", str(a.overlap), *extra]
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=a.timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode or not lines:
        raise SystemExit(f"failed: {' '.join(args)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def launch_scaling(a):
    res = []
    for n in [int(x) for x in a.dp.split(",")]:
        got = run_one(a, n, [])
        res += got
        for r in got:
            print(f"  dp={n} overlap={r['overlap']}: step {r['step_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    by = {(r["dp"], r["overlap"]): r for r in res}
    base = by.get((1, False), res[0])["step_s"]
    print(f"\nDP weak scaling, preset {a.preset}, {res[0]['params']:,} params, {res[0]['n_buckets']} buckets of "
          f"{a.bucket_mb} MiB, B={a.micro_batch_size} T={a.block_size} n_micro={a.n_micro}; median of {a.steps} steps"
          f"{' per mode, on/off alternating' if a.overlap == 2 else ''}")
    print(f"{'dp':>3} {'overlap':>7} {'step ms':>8} {'vs dp1':>7} {'bwd ms':>8} {'exposed':>8} {'sync off':>8} "
          f"{'hidden':>7} {'span est':>8} {'MB sent':>8}")
    for r in res:
        off = by.get((r["dp"], False))
        r["sync_off_s"] = off["exposed_s"] if off else float("nan")
        has = off and r["overlap"] and r["dp"] > 1 and off["exposed_s"] > 0   # dp=1 has nothing to hide
        r["hidden"] = (1 - r["exposed_s"] / off["exposed_s"]) if has else 0.0
        r["hidden_span"] = r["hidden_span"] if r["dp"] > 1 else 0.0
        r["slowdown_vs_dp1"] = r["step_s"] / base
        print(f"{r['dp']:>3} {str(r['overlap']):>7} {r['step_s'] * 1e3:>8.1f} {r['slowdown_vs_dp1']:>7.2f} "
              f"{r['compute_s'] * 1e3:>8.1f} {r['exposed_s'] * 1e3:>8.2f} {r['sync_off_s'] * 1e3:>8.2f} "
              f"{r['hidden']:>7.2f} {r['hidden_span']:>8.2f} {r['bytes_sent'] / 2**20:>8.2f}")
    return dict(kind="dp_scaling", preset=a.preset, bucket_mb=a.bucket_mb, results=res)


def launch_curves(a):
    specs = ["none", "fp16", "bf16", f"topk:{a.topk}", f"topk:{a.topk * 10:g}"]
    res = [run_one(a, 2, ["--curves", "--compress", s, "--preset", "tiny"]) for s in specs]
    dense = res[0]
    print(f"\nCompressed DP sync, dp=2, preset tiny, {a.curve_steps} steps on text (loss: mean of the last 10 steps)")
    print(f"{'compress':>10} {'loss first':>10} {'loss last':>10} {'vs none':>8} {'KB sent':>8} {'bytes ratio':>11}")
    for r in res:
        r["last10"] = sum(r["losses"][-10:]) / 10
        r["bytes_ratio"] = r["bytes_sent"] / dense["bytes_sent"] if dense["bytes_sent"] else float("nan")
        print(f"{r['compress']:>10} {r['losses'][0]:>10.3f} {r['last10']:>10.3f} {r['last10'] - dense['last10']:>+8.3f} "
              f"{r['bytes_sent'] / 1024:>8.1f} {r['bytes_ratio']:>11.3f}")
    return dict(kind="dp_compress", steps=a.curve_steps, results=res)


def main(argv=None):
    a = parse(argv)
    if not a.launch:
        return worker(a)
    out = launch_curves(a) if a.curves else launch_scaling(a)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
