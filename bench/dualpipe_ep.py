"""DualPipeV's overlap of the expert-parallel all-to-all: how much of the all-to-all time 1F1B exposes
does DualPipeV hide when each of its F & B pairs runs interleaved (--pp-overlap on)?

    python bench/dualpipe_ep.py                       # shared memory and the network transport
    python bench/dualpipe_ep.py --quick               # the smoke run (tests/test_bench_cli.py)

Each launch is ``mpiexec -n 4`` of this script as the trainer builds its runner (pympar.config.parse_args,
build_runner): a MoE model (--preset with 4 blocks, every one a MoE block) on dp 2 x pp 2 x ep 2 (the ep group
inside the data-parallel ranks of a stage), --n-micro micro-batches per rank, one kernel thread per
rank, the trainer's default dtype. Three variants, each its own launch, alternating round by round:
  1f1b             the schedule the target compares against;
  dualpipev off    DualPipeV's table, one action after the other (the same work, no overlap);
  dualpipev on     its F & B pairs interleaved (parallel/overlap.py): one micro-batch's all-to-alls in
                   flight while the other micro-batch computes.
Per step and rank: the exposed all-to-all time (the seconds this rank spent inside its all-to-alls:
start and wait, not the partner's compute in between; the step's "ep_comm" of the trace), the step's
time (the slowest rank's) and the bubble. A launch reports the median over its steps after --warmup of
the mean over ranks; the variants' figures are medians over --rounds launches. hidden = 1 - exposed
(dualpipev on) / exposed (1f1b); the target is hidden >= 0.5. The losses of the two dualpipev variants
must be bitwise equal (else the script exits 1).

Before the pairs, the machine's own limit (--transfer-mb): 2 ranks (one per core), an all-to-all of
that many MiB per rank started nonblocking, 5 ms of GEMMs computed behind it (with the compute seams'
progress calls, comm.progress.poke, and without), then waited for; against the blocking call alone.
hidden_transfer = 1 - wait / blocking: how much of a transfer this machine can run behind compute at
all (the MPI library moves shared-memory and TCP-loopback messages with the CPU, inside its calls).

--work model (default): the model's own compute. With 4 ranks on 2 cores a rank's wait inside an
all-to-all is mostly time in which the other ranks hold the cores, and the overlap cannot turn that
into idle time to fill. --work sleep emulates the cores a rank would have to itself: each block's
attention sleeps --attn-ms forward (twice that backward), each rank's experts sleep --row-us per row
they receive forward (twice backward), the rest runs for real -- routing, the all-to-alls, layer
norms, embedding, head and optimizer -- so the all-to-all waits are those of real routing imbalance
and real messages, between ranks whose compute leaves the cores free (bench/pipeline.py's --work
sleep does the same for the pipeline bubble). Its losses are not a model's: the emulated parts
return zeros.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

VARIANTS = (("1f1b", "off"), ("dualpipev", "off"), ("dualpipev", "on"))
TRANSPORTS = {"shared memory": {}, "network": {"MPIR_CVAR_NOLOCAL": "1"}}


def parse(argv=None):
    ap = common.worker_parser(__doc__)
    ap.add_argument("--preset", default="moe-small")
    ap.add_argument("--n-micro", type=int, default=8, help="micro-batches per rank and step")
    ap.add_argument("--n-embd", type=int, default=0, help="the model's width (0: the preset's)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--work", default="model,sleep", help="comma-separated: model (real compute), sleep (emulated)")
    ap.add_argument("--attn-ms", type=float, default=1.5, help="--work sleep: a block's attention forward")
    ap.add_argument("--row-us", type=float, default=1.5, help="--work sleep: an expert's forward per row")
    ap.add_argument("--transfer-mb", default="1,8", help="all-to-all sizes (MiB per rank) of the transfer check")
    ap.add_argument("--part", default="pairs", help=argparse.SUPPRESS)
    ap.add_argument("--schedule", default="1f1b", help=" (worker)")
    ap.add_argument("--overlap", default="off", help=" (worker)")
    common.add_output_args(ap, "dualpipe_ep")
    a = common.resolve_outputs(ap.parse_args(argv))
    if a.quick:
        a.preset, a.steps, a.warmup, a.rounds, a.n_micro, a.micro_batch_size = "moe-tiny", 2, 1, 1, 4, 2
        a.transports, a.work = "shared memory", "model,sleep"
    return a


def worker(a):
    import numpy as np
    from mpi4py import MPI

    from pympar import kernels
    from pympar.config import apply_environment, parse_args
    apply_environment()
    from pympar.comm import MPIComm
    from pympar.data import load_corpus, local_micro_batches
    from pympar.parallel.runner import build_runner

    mpi = MPI.COMM_WORLD
    argv = ["--preset", a.preset, "--n-layer", "4", "--moe-every", "1", "--dp", "2", "--pp", "2", "--ep", "2",
            "--schedule", a.schedule, "--pp-overlap", a.overlap, "--n-micro", str(a.n_micro),
            "--micro-batch-size", str(a.micro_batch_size), "--threads", "1"] + \
        (["--n-embd", str(a.n_embd)] if a.n_embd else [])
    c = parse_args(argv, mpi.Get_size())
    corpus = load_corpus(c.run.data)
    kernels.set_process_threads(1)
    comm = MPIComm(mpi, name="world", timeout=c.run.comm_timeout)
    runner = build_runner(c.model, c.parallel, comm, c.run, c.optim)
    if a.work == "sleep":
        emulate(runner.model, a.attn_ms / 1e3, a.row_us / 1e6)
    lay, dp_rank = c.parallel, runner.mesh.dp_rank
    rows, losses = [], []
    for s in range(a.warmup + a.steps):
        mbs = local_micro_batches(corpus.train, c.run.seed, s, dp_rank, lay.n_micro, lay.micro_batch_size,
                                  c.model.block_size)
        comm.barrier()
        t0 = time.perf_counter()
        res = runner.train_step(mbs, c.optim.lr)
        dt = time.perf_counter() - t0
        ex = runner.executor.stats
        rows.append([res.time_split["ep_comm"], dt, ex["bubble"], ex.get("overlapped_pairs", 0)])
        losses.append(res.loss)
    got = np.array(rows, np.float64)                                # host
    every = mpi.gather(got, root=0)
    if mpi.Get_rank() == 0:
        allr = np.stack(every)                                      # (ranks, steps, 4)
        timed = allr[:, a.warmup:, :]
        out = dict(schedule=a.schedule, overlap=a.overlap, work=a.work, dtype=c.run.dtype, ranks=mpi.Get_size(),
                   exposed_a2a_s=float(np.median(timed[:, :, 0].mean(axis=0))),
                   step_s=float(np.median(timed[:, :, 1].max(axis=0))),
                   bubble=float(np.median(timed[:, :, 2].mean(axis=0))),
                   pairs=int(timed[0, -1, 3]), losses=losses)
        print("ROWS " + json.dumps(out), flush=True)


def transfer_worker(a):
    """2 ranks: per --transfer-mb size, the blocking all-to-all, and the nonblocking one with 5 ms of
    GEMMs behind it (poked and not), median over rounds of the wait after the compute."""
    import numpy as np
    from mpi4py import MPI

    from pympar import kernels
    from pympar.comm import MPIComm, progress

    kernels.set_process_threads(1)
    comm = MPIComm(MPI.COMM_WORLD, name="world")
    g = np.random.default_rng(0).random((256, 256)).astype(np.float32)

    def compute(poke):
        end = time.perf_counter() + 5e-3
        while time.perf_counter() < end:
            g @ g
            if poke:
                progress.poke()

    out = []
    for mb in [float(x) for x in a.transfer_mb.split(",")]:
        rows = int(mb * 2**20) // (256 * 4)
        x = np.ones((rows * comm.size, 256), np.float32)
        counts = np.full(comm.size, rows, np.int64)
        got = {}
        for mode in ("blocking", "behind, no poke", "behind, poked") * 2:
            ws = []
            for _ in range(5 if a.quick else 15):
                comm.barrier()
                if mode == "blocking":
                    t = time.perf_counter()
                    comm.alltoallv(x, counts, counts)
                    ws.append(time.perf_counter() - t)
                    continue
                req = comm.ialltoallv(x, counts, counts)
                if mode == "behind, poked":
                    progress.behind(req)
                compute(mode == "behind, poked")
                progress.forget(req)
                t = time.perf_counter()
                req.wait()
                ws.append(time.perf_counter() - t)
            got.setdefault(mode, []).append(statistics.median(ws))
        t = np.array([min(got[m]) for m in got])               # host: each mode's better pass
        slowest = np.empty_like(t)
        MPI.COMM_WORLD.Allreduce(t, slowest, op=MPI.MAX)
        out.append(dict(mb=mb, **{m: float(v) for m, v in zip(got, slowest)},
                        hidden_transfer=float(1 - slowest[2] / slowest[0])))
    if comm.rank == 0:
        print("ROWS " + json.dumps(out), flush=True)


def emulate(model, attn_s, row_s):
    """--work sleep: every block's attention and every rank's experts sleep instead of computing
    (outputs zeros, gradients untouched); the rest of the model runs as it is."""
    import numpy as np

    from pympar.comm.progress import poke

    def compute(t):                              # sleeps in 0.25 ms slices, a seam between them (the
        end = time.perf_counter() + t            # products of a real layer: comm.progress.poke)
        while (left := end - time.perf_counter()) > 0:
            time.sleep(min(left, 2.5e-4))
            poke()

    def attn_forward(x):
        compute(attn_s)
        return np.zeros_like(x), (x, None)

    def attn_backward(dy, ctx):
        compute(2 * attn_s)
        return np.zeros_like(dy)

    def experts_forward(xs, counts, experts=None):
        compute(row_s * len(xs))
        return np.zeros_like(xs), len(xs)

    def experts_backward(dys, n):
        compute(2 * row_s * n)
        return np.zeros_like(dys)

    for chunk in model.chunks:
        for block in chunk.h:
            block.attn.forward, block.attn.backward = attn_forward, attn_backward
            moe = getattr(block, "moe", None)
            if moe is not None:
                moe.run_experts, moe.run_experts_backward = experts_forward, experts_backward


def run(a) -> dict:
    transfer = []
    for tname in a.transports.split(","):
        for r in common.run_worker(2, Path(__file__), ["--part", "transfer", "--transfer-mb", a.transfer_mb] +
                                   (["--quick"] if a.quick else []), a.timeout, TRANSPORTS[tname]):
            transfer.append(dict(transport=tname, **r))
            print(f"transfer {tname:14s} {r['mb']:4.0f} MiB: blocking {1e3 * r['blocking']:6.2f} ms; waited after 5 ms "
                  f"of compute: {1e3 * r['behind, no poke']:6.2f} ms (no poke), {1e3 * r['behind, poked']:6.2f} ms "
                  f"(poked): hidden {r['hidden_transfer']:.2f}", flush=True)
    rows = []
    for work, tname in [(w, t) for w in a.work.split(",") for t in a.transports.split(",")]:
        per = {v: [] for v in VARIANTS}
        for rnd in range(a.rounds):
            order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
            for sched, ov in order:
                args = ["--preset", a.preset, "--n-embd", a.n_embd, "--n-micro", a.n_micro, "--micro-batch-size", a.micro_batch_size,
                        "--steps", a.steps, "--warmup", a.warmup, "--schedule", sched, "--overlap", ov,
                        "--work", work, "--attn-ms", a.attn_ms, "--row-us", a.row_us]
                r = common.run_worker(4, Path(__file__), args, a.timeout, TRANSPORTS[tname])
                per[(sched, ov)].append(r)
                print(f"{work:5s} {tname:14s} round {rnd} {sched:10s} overlap {ov:3s}: exposed a2a {1e3 * r['exposed_a2a_s']:7.2f} ms"
                      f"  step {1e3 * r['step_s']:7.1f} ms  bubble {r['bubble']:.3f}  pairs {r['pairs']}", flush=True)
        for runs in zip(per[("dualpipev", "off")], per[("dualpipev", "on")]):
            if runs[0]["losses"] != runs[1]["losses"]:
                raise SystemExit(f"dualpipev with and without the overlap differ: {runs[0]['losses']} vs {runs[1]['losses']}")
        med = {v: {k: statistics.median(r[k] for r in rs) for k in ("exposed_a2a_s", "step_s", "bubble")}
               for v, rs in per.items()}
        base, off, on = med[("1f1b", "off")], med[("dualpipev", "off")], med[("dualpipev", "on")]
        rows.append(dict(work=work, transport=tname, dtype=per[VARIANTS[0]][0]["dtype"],
                         variants=[dict(schedule=s, overlap=o, **med[(s, o)], runs=per[(s, o)]) for s, o in VARIANTS],
                         hidden_vs_1f1b=1.0 - on["exposed_a2a_s"] / base["exposed_a2a_s"],
                         hidden_vs_sequential=1.0 - on["exposed_a2a_s"] / off["exposed_a2a_s"],
                         step_on_over_1f1b=on["step_s"] / base["step_s"],
                         step_on_over_off=on["step_s"] / off["step_s"]))
        r = rows[-1]
        print(f"{work}, {tname}: hidden {r['hidden_vs_1f1b']:.2f} of 1F1B's exposed all-to-all time "
              f"({r['hidden_vs_sequential']:.2f} of the same table run sequentially); step time on/1f1b "
              f"{r['step_on_over_1f1b']:.2f}, on/off {r['step_on_over_off']:.2f}", flush=True)
    targets = {f"DualPipeV --pp-overlap on: share of 1F1B's exposed EP all-to-all time hidden, the model's compute, "
               f"{r['transport']} (target >= 0.5)": r["hidden_vs_1f1b"] for r in rows if r["work"] == "model"}
    return dict(bench="dualpipe_ep", machine=common.machine(), targets=targets, preset=a.preset, layout="dp2 pp2 ep2, every block MoE",
                n_micro=a.n_micro, micro_batch_size=a.micro_batch_size, steps=a.steps, warmup=a.warmup,
                rounds=a.rounds, attn_ms=a.attn_ms, row_us=a.row_us, target="hidden_vs_1f1b >= 0.5", rows=rows,
                transfer=transfer)


def plot(res, png) -> None:
    plt = common.pyplot()
    rows = res["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3))
    labels = [f"{v['schedule']}{' overlap' if v['overlap'] == 'on' else ''}" for v in rows[0]["variants"]]
    width = 0.8 / len(rows)
    for k, (ax, key, title) in enumerate(zip(axes, ("exposed_a2a_s", "step_s"),
                                             ("exposed all-to-all per step (ms)", "step time (ms)"))):
        for j, r in enumerate(rows):
            xs = [i + j * width for i in range(len(labels))]
            ax.bar(xs, [1e3 * v[key] for v in r["variants"]], width, label=f"{r['work']}, {r['transport']}")
        ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(len(labels))], labels)
        ax.set_title(title)
        if k == 0:
            ax.legend()
    ax, tr = axes[2], res.get("transfer", [])
    modes = ("blocking", "behind, no poke", "behind, poked")
    for j, mode in enumerate(modes):
        ax.bar([i + j * 0.27 for i in range(len(tr))], [1e3 * t[mode] for t in tr], 0.27, label=mode)
    ax.set_xticks([i + 0.27 for i in range(len(tr))], [f"{t['transport']}\n{t['mb']:g} MiB" for t in tr])
    ax.set_title("2 ranks: a2a wait after 5 ms compute (ms)")
    ax.legend()
    fig.suptitle(f"DualPipeV's F&B overlap, {res['preset']} MoE, {res['layout']} ({res['rows'][0]['dtype']})")
    common.save(fig, png)


def main(argv=None):
    a = parse(argv)
    if a.worker:
        (transfer_worker if a.part == "transfer" else worker)(a)
        return None
    res = run(a)
    common.write_outputs(a, res, plot)
    return res


if __name__ == "__main__":
    main()
