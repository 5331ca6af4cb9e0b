"""Data-parallel training step: pympar's DP (the trainer's ParallelRunner, bucketed allreduce
overlapped with backward) against PyTorch DistributedDataParallel on gloo, same model, same
weights, same data, same global batch, same number of processes, one thread per process.

    python bench/ddp_step.py --presets small,moe-small --world 2,4 --rounds 3
    python bench/ddp_step.py --presets tiny --world 2 --rounds 1 --steps 2 --json /tmp/d.json

Both sides are launched the same way: ``mpiexec -n N python bench/ddp_step.py --worker pympar|torch``
(bench/common.launch: oversubscribed, OMP/BLAS/pympar threads 1). The torch worker takes its
rank and size from the launcher's PMI_RANK/PMI_SIZE, initialises gloo over TCP on 127.0.0.1
and never touches MPI; the pympar worker builds the runner exactly as ``python -m
pympar.train`` does (pympar.config.parse_args, build_runner) and calls ``train_step``.

Per step: a barrier (untimed), then on every rank zero grads, forward + backward of its
micro-batch (global micro-batch dp_rank, pympar.data), gradient mean over the ranks,
clip at 1.0, AdamW (lr constant), and the global mean loss (pympar: the runner's one world
allreduce of [loss, non-finite, norm^2]; torch: one all_reduce of the loss). The step's time
is the slowest rank's. A launch reports the median over its steps after --warmup; the two
sides alternate launch by launch (--rounds R: pympar, torch, pympar, torch, ...) so load
drift hits both, and the ratio reported is the median of the per-round ratios
(tokens/s pympar / tokens/s torch: > 1 means pympar is faster).

MoE presets: an expert that gets no token on a rank has no gradient in torch's graph, which DDP
accepts only with find_unused_parameters=True (an extra graph walk per step, on the torch side
only; recorded per row). pympar allreduces that expert's zero gradients as usual.

Same work: both sides' global mean loss at step 0 (same weights, same batch) must agree to
--loss-rtol, else the script exits 1; step 1's loss (after one synchronised update) is
reported too.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402



def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="small,moe-small", help="comma-separated model presets")
    ap.add_argument("--world", default="2,4", help="comma-separated process counts")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per step over all ranks")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps per launch")
    ap.add_argument("--rounds", type=int, default=3, help="launches per side, alternating; medians kept")
    ap.add_argument("--loss-rtol", type=float, default=1e-4, help="step-0 loss agreement required")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    ap.add_argument("--worker", choices=("pympar", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="small", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    common.add_output_args(ap, "ddp_step")
    return common.resolve_outputs(ap.parse_args(argv))


# --- the shared setup of both workers ----------------------------------------------------------
def setup(a, world):
    """(the TrainConfig, corpus) exactly as ``python -m pympar.train`` resolves them for pure DP."""
    from pympar.config import parse_args
    from pympar.data import load_corpus

    if a.global_batch % world:
        raise SystemExit(f"--global-batch {a.global_batch} is not divisible by {world} ranks")
    argv = ["--preset", a.preset, "--dp", str(world), "--micro-batch-size", str(a.global_batch // world),
            "--n-micro", "1", "--threads", "1"]
    c = parse_args(argv, world)
    model_cfg = c.model
    corpus = load_corpus(c.run.data)          # the trainer's default: byte tokens (pympar.train would
    if corpus.vocab_size > model_cfg.vocab_size:   # grow vocab_size; importing it starts MPI)
        raise SystemExit(f"preset {a.preset}: vocab_size {model_cfg.vocab_size} < the corpus's {corpus.vocab_size}")
    return c, corpus


def batches(c, corpus, step, rank):
    from pympar.data import local_micro_batches
    return local_micro_batches(corpus.train, c.run.seed, step, rank, 1, c.parallel.micro_batch_size, c.model.block_size)


def result(a, side, world, c, n_params, times, losses, **extra):
    """The RESULT line rank 0 prints: per-step times are already the slowest rank's."""
    timed = times[a.warmup:] or times
    step_s = statistics.median(timed)
    tokens = c.parallel.micro_batch_size * world * c.model.block_size
    out = dict(side=side, preset=a.preset, world=world, per_rank_batch=c.parallel.micro_batch_size, seq=c.model.block_size,
               params=n_params, tokens_per_step=tokens, step_s=step_s, tokens_per_s=tokens / step_s,
               steps=len(timed), step_times=timed, losses=losses, **extra)
    print("RESULT " + json.dumps(out), flush=True)


# --- pympar worker (inside mpiexec) --------------------------------------------------------
def worker_pympar(a):
    import numpy as np
    from mpi4py import MPI

    from pympar import kernels
    from pympar.config import apply_environment
    apply_environment()
    from pympar.comm import MPIComm
    from pympar.parallel.runner import build_runner

    mpi = MPI.COMM_WORLD
    world = mpi.Get_size()
    c, corpus = setup(a, world)
    kernels.set_process_threads(1)
    comm = MPIComm(mpi, name="world", timeout=c.run.comm_timeout)
    runner = build_runner(c.model, c.parallel, comm, c.run, c.optim)
    times, losses = [], []
    for s in range(a.warmup + a.steps):
        mbs = batches(c, corpus, s, mpi.Get_rank())
        comm.barrier()
        t0 = time.perf_counter()
        res = runner.train_step(mbs, c.optim.lr)
        times.append(time.perf_counter() - t0)
        losses.append(res.loss)
    t = np.array(times, np.float64)
    mpi.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)                    # the slowest rank's step
    times = t.tolist()
    if mpi.Get_rank() == 0:
        result(a, "pympar", world, c, runner.n_params, times, losses)


# --- torch worker (inside mpiexec, no MPI calls) ---------------------------------------------
def worker_torch(a):
    import numpy as np
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(common.ROOT / "tests"))
    from torch_ref import TorchGPT, load_numpy_state

    from pympar.nn import GPT
    from pympar.optim import decays

    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    c, corpus = setup(a, world)
    model_cfg, run, optim = c.model, c.run, c.optim
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=world)
    tm = TorchGPT(model_cfg).float()
    load_numpy_state(tm, GPT(model_cfg, seed=run.seed, dtype=np.float32).state_dict())   # the runner's weights
    # the MoE expert_bias stays rank-local as in pympar (equal, never updated here); an expert that gets no
    # token on a rank leaves its parameters out of the graph, which DDP only accepts with find_unused_parameters
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*")
    ddp = torch.nn.parallel.DistributedDataParallel(tm, bucket_cap_mb=run.bucket_mb, broadcast_buffers=False,
                                                    find_unused_parameters=model_cfg.n_expert > 0)
    named = list(tm.named_parameters())
    opt = torch.optim.AdamW(
        [dict(params=[p for n, p in named if decays(n, p.detach().numpy())], weight_decay=optim.weight_decay),
         dict(params=[p for n, p in named if not decays(n, p.detach().numpy())], weight_decay=0.0)],
        lr=optim.lr, betas=(0.9, 0.95), eps=1e-8)
    params = [p for _, p in named]
    times, losses = [], []
    for s in range(a.warmup + a.steps):
        (x, y), = batches(c, corpus, s, rank)
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        _, loss = ddp(x, y)
        loss.backward()                                  # DDP's buckets allreduce during backward
        torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        opt.step()
        g = loss.detach().reshape(1).clone()
        dist.all_reduce(g)
        times.append(time.perf_counter() - t0)
        losses.append(float(g[0]) / world)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    n_params = sum(p.numel() for p in tm.parameters())  # the tied lm_head counted once
    if rank == 0:
        result(a, "torch", world, c, n_params, t.tolist(), losses,
               find_unused_parameters=ddp.find_unused_parameters)
    dist.barrier()                                       # no rank tears gloo down under another
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # skip interpreter teardown: twice in the first dozen launches a rank aborted there after RESULT
                  # ("terminate called without an active exception", a joinable C++ thread destroyed)


# --- launcher ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, side: str, preset: str, world: int) -> dict:
    args = [__file__, "--worker", side, "--preset", preset, "--global-batch", a.global_batch,
            "--steps", a.steps, "--warmup", a.warmup, "--port", free_port()]
    p = common.launch(world, args, a.timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode or not lines:
        raise SystemExit(f"{side} worker, preset {preset}, {world} ranks failed ({p.returncode}):\n"
                         f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def measure(a, preset: str, world: int) -> dict:
    """R alternating launches per side; the row of the comparison."""
    rounds = []
    for r in range(a.rounds):
        pm = launch(a, "pympar", preset, world)
        th = launch(a, "torch", preset, world)
        rounds.append(dict(pympar_step_s=pm["step_s"], torch_step_s=th["step_s"],
                           ratio=th["step_s"] / pm["step_s"], pympar_losses=pm["losses"], torch_losses=th["losses"]))
        print(f"  {preset} w{world} round {r + 1}: pympar {pm['step_s'] * 1e3:.1f} ms, torch {th['step_s'] * 1e3:.1f} ms, "
              f"ratio {rounds[-1]['ratio']:.2f}x; loss0 {pm['losses'][0]:.6f} / {th['losses'][0]:.6f}",
              file=sys.stderr, flush=True)
    first = rounds[0]
    pl, tl = first["pympar_losses"], first["torch_losses"]
    t_p = statistics.median(x["pympar_step_s"] for x in rounds)
    t_t = statistics.median(x["torch_step_s"] for x in rounds)
    row = dict(preset=preset, world=world, per_rank_batch=pm["per_rank_batch"], seq=pm["seq"],
               global_batch=a.global_batch, params=pm["params"], torch_params=th["params"],
               torch_find_unused_parameters=th["find_unused_parameters"],
               tokens_per_step=pm["tokens_per_step"], pympar_step_s=t_p, torch_step_s=t_t,
               pympar_tokens_per_s=pm["tokens_per_step"] / t_p, torch_tokens_per_s=pm["tokens_per_step"] / t_t,
               ratio=statistics.median(x["ratio"] for x in rounds),
               rounds=[{k: x[k] for k in ("pympar_step_s", "torch_step_s", "ratio")} for x in rounds],
               loss0_pympar=pl[0], loss0_torch=tl[0], loss0_rel_diff=abs(pl[0] - tl[0]) / abs(tl[0]),
               loss1_pympar=pl[1] if len(pl) > 1 else None, loss1_torch=tl[1] if len(tl) > 1 else None)
    row["same_loss"] = row["loss0_rel_diff"] <= a.loss_rtol
    return row


def plot(res: dict, png) -> None:
    plt = common.pyplot()
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(5, 0.5 + 0.4 * len(rows)))
    labels = [f"{r['preset']}, {r['world']} ranks" for r in rows][::-1]
    vals = [r["ratio"] for r in rows][::-1]
    ax.barh(range(len(rows)), vals, color="tab:blue")
    ax.set_yticks(range(len(rows)), labels)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.2f}x", va="center")
    ax.axvline(1.0, color="k", lw=0.6)
    ax.set(xlabel="tokens/s pympar DP / torch DDP (gloo)", xlim=(0, max(vals + [1.0]) * 1.25),
           title=f"DP step, global batch {res['global_batch']}, 1 thread per rank")
    common.save(fig, png)


def run(a) -> dict:
    rows = []
    for preset in [p for p in a.presets.split(",") if p]:
        for world in [int(w) for w in a.world.split(",") if w]:
            rows.append(measure(a, preset, world))
    print(f"\nDP step: pympar (ParallelRunner) vs torch DDP (gloo), global batch {a.global_batch}, 1 thread per rank, "
          f"median of {a.steps} steps after {a.warmup}, {a.rounds} alternating round(s)")
    print(f"{'preset':<10}{'ranks':>6}{'pympar tok/s':>14}{'torch tok/s':>13}{'ratio':>8}{'loss0 pympar':>14}"
          f"{'loss0 torch':>13}{'loss1 pympar':>14}{'loss1 torch':>13}")
    for r in rows:
        l1 = (f"{r['loss1_pympar']:>14.6f}{r['loss1_torch']:>13.6f}" if r["loss1_pympar"] is not None else "")
        print(f"{r['preset']:<10}{r['world']:>6}{r['pympar_tokens_per_s']:>14.0f}{r['torch_tokens_per_s']:>13.0f}"
              f"{r['ratio']:>7.2f}x{r['loss0_pympar']:>14.6f}{r['loss0_torch']:>13.6f}{l1}")
    import torch
    return dict(kind="ddp_step", machine=common.machine(), torch_version=torch.__version__,
                global_batch=a.global_batch, steps=a.steps, warmup=a.warmup, rounds=a.rounds,
                loss_rtol=a.loss_rtol, rows=rows)


def main(argv=None):
    a = parse(argv)
    if a.worker == "pympar":
        return worker_pympar(a)
    if a.worker == "torch":
        return worker_torch(a)
    res = run(a)
    common.write_outputs(a, res, plot)
    bad = [r for r in res["rows"] if not r["same_loss"]]
    if bad:
        print("step-0 losses differ beyond --loss-rtol: " + "; ".join(
            f"{r['preset']} w{r['world']}: {r['loss0_pympar']:.6f} vs {r['loss0_torch']:.6f}" for r in bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
