"""Train a GPT (dense or Mixture-of-Experts) with pympar on any number of MPI ranks.

Runbook (from the repository root, or anywhere once pympar is installed):

    python -m pympar.train --preset tiny --steps 200             # one process
    mpirun -n 4 python -m pympar.train --preset tiny --steps 200  # 4 ranks, layout chosen (dp=4)
    mpirun -n 8 python -m pympar.train --preset small --dp 8 --n-micro 2 --micro-batch-size 4 \\
        --steps 500 --eval-every 100 --out runs/small
    mpirun -n 8 python -m pympar.train --preset moe-tiny --steps 100 --out runs/moe --profile
    mpirun -n 32 python -m pympar.train --preset tiny --steps 20  # oversubscribes a small machine
    python -m pympar.train --config run.toml --lr 3e-4            # TOML file, flags override it
    python -m pympar.report runs/small                            # PNG plots of a finished run
    python -m pympar.train --help                                 # every option with its default

With no ``--data`` the corpus is this Python's standard-library source (byte tokens,
cached under $PYMPAR_CACHE or ~/.cache/pympar); see pympar.data for the other formats.
Set OMP_NUM_THREADS=1 when there are more ranks than cores.

What a run writes under ``--out DIR``: metrics.jsonl (one JSON object per step), summary.json
(the configuration and final numbers), trace.json with ``--profile`` (Chrome trace, one
process row per rank; open it in https://ui.perfetto.dev).

Every rank validates the configuration and the data on its own before the first
collective; a bad configuration makes every rank print ``pympar.train: error: ...`` and
exit with status 2.

Exit status: 0 done; 2 a bad configuration or data; 4 stopped after --max-bad-steps non-finite
steps; 74 a checkpoint could not be written, the disk full (the previous one is kept; free space
and rerun with ``--resume auto``); 75 stopped on request -- SIGTERM, SIGINT or SIGUSR1 to any rank (Slurm's preemption,
``scancel``, ``--signal=USR1@120``, Ctrl-C): at the end of the step the ranks save a checkpoint to
OUT/checkpoints (with --out) and stop together; rerun the same command with ``--resume auto``.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import backend, kernels
from . import layout as layouts
from .comm.objects import gather_object
from .config import apply_environment, describe, parse_args, resolve_dtype
from .data import VAL, Corpus, load_corpus, local_micro_batches, micro_batch
from .kernels import gemm
from .resilience import (DISK_FULL_STATUS, RESUMABLE_STATUS, STOP_STATUS, BadStepGuard, Heartbeat, NonFiniteStop, StopRequest,
                     check_resumable, resolve_resume, restore_run, save_run)
from .metrics import MetricsWriter, measure_cpu_peak, measure_matmul_peak, moe_layer_stats, read_records
from .nn.config import flops_per_token
from .parallel import ledger
from .optim import cosine_lr
from .parallel.cores import share_cores
from .parallel.mesh import Mesh
from .parallel.runner import build_runner
from .profile import SPLIT, Recorder, write_chrome_trace


def main(argv=None, faults=None) -> int:
    """The trainer (the module docstring); returns the exit status. ``faults``: a test harness's
    injector factory, ``faults(rank, model)`` -> an object whose ``begin_step(step)`` runs before
    every step (tests/faulty_train.py); a normal run has none."""
    from mpi4py import MPI                     # MPI_Init; no collective yet

    mpi = MPI.COMM_WORLD
    beats = []                                 # under pympar.launch: the heartbeat the supervisor watches
    try:
        return _main(mpi, argv, faults, beats)
    finally:
        for b in beats:
            b.stop()


def _main(mpi, argv, faults, beats) -> int:
    rank, world = mpi.Get_rank(), mpi.Get_size()
    argv = sys.argv[1:] if argv is None else list(argv)

    # 1. validate everything on every rank, without communicating
    try:
        quiet = contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext()
        # the environment, read once, here; auto's choices never change a training run's bits
        env = apply_environment(tuning_default="reproducible")
        beats += [b for b in [Heartbeat.start(env, rank)] if b is not None]
        kernels.require_native("pympar.train")   # never train (and report tokens/s) on the reference by mistake
        with quiet:                            # --help is printed by rank 0 only
            cfg = parse_args(argv, world, env)
        model_cfg, run = cfg.model, cfg.run
        corpus = load_corpus(run.data, cache_dir=env.cache_dir)
        model_cfg = _fit_vocab(model_cfg, run, corpus)
        corpus.check_block_size(model_cfg.block_size)
        cfg.model = model_cfg
        layouts.check(model_cfg, cfg.parallel, device=run.device)
        if run.device == "cuda":
            from . import gpu
            resolve_dtype(run, gpu.bfloat16_supported())
            _check_gpu(run)
        resume_path = resolve_resume(run, warn=None if rank else (
            lambda m: os.write(2, f"pympar.train: warning: {m}\n".encode(errors="backslashreplace"))))
        if resume_path is not None:
            check_resumable(resume_path, model_cfg, run.steps)
    except ValueError as e:                    # ConfigError, DataError, NotSupportedError
        sys.stderr.flush()                     # one write per line: ranks' lines must not interleave
        os.write(2, f"pympar.train: error: {e}\n".encode(errors="backslashreplace"))
        return 2
    except SystemExit as e:                    # --help
        return int(e.code or 0)

    # 2.-4. no rank may be left waiting: a stalled collective (or one that does not match, with
    # PYMPAR_DEBUG_COLLECTIVES=1) or any other error after this point ends the whole job
    from .checkpoint import CheckpointDiskFull, CheckpointError
    from .comm import CommTimeoutError
    from .parallel.ep import NodeRouteError
    from .comm.debug import CollectiveMismatchError
    from .comm.watchdog import abort_job
    facts = {}                                 # what the error lines below may cite
    try:
        return _train(mpi, cfg, corpus, resume_path, env, faults, facts)
    except (CommTimeoutError, CollectiveMismatchError) as e:
        abort_job(e)
    except CheckpointDiskFull as e:            # agreed on every rank; the previous checkpoint is the latest
        if rank == 0:
            sys.stderr.flush()
            os.write(2, f"pympar.train: error: the disk is full: {e}. The previous checkpoint is kept: free space "
                        f"and run the same command with --resume auto (pympar.launch waits for space and resumes "
                        f"by itself)\n".encode(errors="backslashreplace"))
        return DISK_FULL_STATUS
    except (NodeRouteError, CheckpointError, MemoryRefused) as e:
        # found by the ranks together (their nodes; a checksum while loading; the nodes' memory):
        # agreed, the same words on every rank
        sys.stderr.flush()
        os.write(2, f"pympar.train: error: {e}\n".encode(errors="backslashreplace"))
        return 2
    except NonFiniteStop as e:                 # agreed on every rank: all stop together
        sys.stderr.flush()
        os.write(2, f"pympar.train: error: rank {rank}: {e}\n".encode(errors="backslashreplace"))
        return STOP_STATUS
    except MemoryError as e:                   # what the ledger did not foresee (--no-memory-check, other jobs)
        peak = facts.get("predicted_peak")
        msg = (f"out of memory ({str(e) or 'an allocation failed'})"
               + (f"; the ledger predicted {ledger.human(peak)} for the worst rank" if peak is not None else "")
               + " (--memory-check, on by default, refuses a run whose prediction cannot fit)")
        if world == 1:
            sys.stderr.flush()
            os.write(2, f"pympar.train: error: rank {rank}: {msg}\n".encode(errors="backslashreplace"))
            return 1
        abort_job(MemoryError(msg), status=1, what="error")
    except Exception as e:
        if world == 1:
            raise
        import traceback
        traceback.print_exc()
        abort_job(RuntimeError(f"unexpected {type(e).__name__} on this rank: {e}"), status=1, what="error")


def _train(mpi, cfg, corpus, resume_path, env, faults=None, facts=None) -> int:
    rank, world = mpi.Get_rank(), mpi.Get_size()
    model_cfg, lay, optim, run = cfg.model, cfg.parallel, cfg.optim, cfg.run
    # 2. set up: communicator, model replica(s), recorder, the measured peak
    from .comm import MPIComm
    # --threads or the environment, else the node's cores over its ranks (parallel/cores.py)
    threads, threads_why = share_cores(mpi, run.threads, run.threads_from, run.bind)
    if run.device == "cuda":                  # one GPU per rank; NCCL for device arrays, MPI for host ones
        from . import gpu
        gpu.select_device(mpi, env.local_rank)
        comm = gpu.device_world(mpi, timeout=run.comm_timeout, nccl=env.nccl)
    else:
        # a timeout ends the job with the report either way (main's handler): "abort" also lets
        # auto choose the library's blocking collectives (comm/tuning.py)
        comm = MPIComm(mpi, name="world", timeout=run.comm_timeout, on_timeout="abort")
    dp_rank = Mesh.coords(rank, lay.dp, lay.pp, lay.tp, lay.cp).dp   # this rank's data shard
    rec = Recorder(enabled=run.profile)
    predicted = ledger.predict_run(model_cfg, lay, run, optim)     # the worst pipeline rank's
    facts["predicted_peak"] = predicted["peak"]
    if run.memory_check and run.device == "cpu":
        _check_memory(mpi, model_cfg, lay, run, optim, predicted)
    runner = build_runner(model_cfg, lay, comm, run, optim, rec)
    pp_overlap = runner.pp_overlap                                 # --pp-overlap made concrete
    peak = float(comm.allreduce(np.array([_peak(run, comm)]))[0])  # all ranks at once, summed
    guard = BadStepGuard(run.max_bad_steps, getattr(runner, "scaler", None))
    injector = faults(rank, runner.model) if faults is not None else None
    start = restore_run(runner, resume_path, guard, comm) if resume_path else 0
    fpt = flops_per_token(model_cfg)
    B, T = lay.micro_batch_size, model_cfg.block_size
    tokens_per_step = B * lay.n_micro * lay.dp * T
    out = Path(run.out) if run.out else None
    if rank == 0:
        if out:
            out.mkdir(parents=True, exist_ok=True)
        how = ("chosen by the planner: " + f"micro-batch {lay.micro_batch_size} x {lay.n_micro}, {lay.schedule}"
               + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else "") + (f", ZeRO-{lay.zero}" if lay.zero else "")
               + (", sequence parallel" if lay.seq_parallel else "")) if run.layout == "auto" else \
              ("chosen for the world size" if run.layout_auto else "as given")
        if lay.pp > 1 and lay.schedule == "dualpipev":
            why = runner.pp_overlap_why
            how += (f"); DualPipeV's F & B pairs {'interleaved' if pp_overlap else 'one action after the other'} "
                    f"(--pp-overlap {run.pp_overlap}{': ' + why if why else ''}")
        print(f"pympar.train: {world} rank(s), layout {lay} ({how}); {threads} thread(s) per rank ({threads_why}); "
              f"kernels {kernels.describe() if run.device != 'cuda' else 'CUDA'}; "
              f"GEMM {'cuBLAS' if run.device == 'cuda' else gemm.describe()}; "
              f"compute {run.dtype}" + (f" ({run.dtype_from})" if run.dtype_from else "")
              + (f", bf16 products on {gemm.describe_bf16()}" if run.dtype == "bfloat16" and run.device == "cpu" else "")
              + f"; data {corpus.name}: "
              f"{len(corpus.train):,} train / {len(corpus.val):,} val tokens, vocab {model_cfg.vocab_size}")
        print(f"pympar.train: model {run.preset} {runner.n_params:,} params, {fpt / 1e6:.2f} MFLOP/token; "
              f"global batch {B}x{lay.n_micro}x{lay.dp} sequences x {T} = {tokens_per_step:,} tokens; "
              f"matmul peak {peak / 1e9:.1f} GFLOP/s in {'bf16' if run.dtype == 'bfloat16' or run.device == 'cuda' else 'float32'} "
              f"(all ranks)", flush=True)
        print(f"pympar.train: memory per rank (ledger, predicted; worst rank): {ledger.describe(predicted)}; "
              f"this process holds {ledger.describe(runner.held())}", flush=True)
        if resume_path:
            print(f"pympar.train: resumed from {resume_path} at step {start}" +
                  (f"; --steps is {run.steps}: nothing left to train (raise --steps, or resume an earlier "
                   f"checkpoint)" if start >= run.steps else ""), flush=True)
    kept = _metrics_before(out / "metrics.jsonl", start) if (out and rank == 0 and start) else []
    metrics = MetricsWriter(out / "metrics.jsonl" if (out and rank == 0) else None)
    for line in kept:                          # a resumed run continues the file of the first
        metrics.write(line)
    eval_batches = [micro_batch(corpus.val, run.seed, 0, g, B, T, VAL) for g in range(dp_rank, run.eval_iters, lay.dp)]

    # 3. the loop: one optimizer step per global batch
    comm.barrier()
    rec.reset_origin()
    rec.take_totals()
    bar = _progress(rank, run.steps, run.progress, launched=env.launched)
    history, val_loss, t_start = [], None, time.perf_counter()
    stop = StopRequest().install()             # SIGTERM/SIGINT/SIGUSR1: stop at the end of a step, saved
    pending = None                             # --async-save: the checkpoint being written in the background
    staging = {}                               # ... and the host buffers it is copied into, reused
    for step in range(start, run.steps):
        if injector is not None:
            injector.begin_step(step)
        lr = cosine_lr(step, optim.lr, min(optim.warmup, run.steps), run.steps, optim.min_lr)
        batches = local_micro_batches(corpus.train, run.seed, step, dp_rank, lay.n_micro, B, T)
        t0 = time.perf_counter()
        res = runner.train_step(batches, lr, stop=stop.pending, written=pending is not None and pending.written)
        dt = time.perf_counter() - t0
        rec.add(f"step {step}", "step", t0, dt)
        do_eval = step == run.steps - 1 or bool(run.eval_every and (step + 1) % run.eval_every == 0)
        if do_eval:
            val_loss = runner.eval_loss(eval_batches)
        tok_s = tokens_per_step / dt
        mem = res.memory                    # every rank's figures, from the step's one allreduce
        record = {
            "step": step, "loss": res.loss, "val_loss": val_loss if do_eval else None,
            "lr": lr, "grad_norm": res.grad_norm, "tokens_per_s": tok_s, "mfu": tok_s * fpt / peak,
            "step_time": dt, "time_split": res.time_split, "loss_scale": res.loss_scale,
            "skipped": res.skipped, **ledger.memory_record(mem),
            "moe": [dict(layer=s["layer"], dropped_fraction=s["dropped_fraction"], **moe_layer_stats(s["tokens_per_expert"]),
                         **{k: s[k] for k in ("rows_per_ep_rank", "rank_max_over_mean") if k in s})
                    for s in res.moe],
        }
        if res.pipeline.get("table_costs"):        # --pp-costs measured: what this step's table was built for
            record["pp_table_costs"] = [list(c) for c in res.pipeline["table_costs"]]
        try:
            record.update(guard.after_step(step, res, comm, runner.sync.named_grads()))
        except NonFiniteStop:
            metrics.write(dict(record, nonfinite=True))   # the last step is logged, then all ranks stop
            raise
        if pending is not None and res.all_written:    # every rank's file is on disk: publish
            pending.finish()
            pending = None
        saved = None
        if run.save_every and (step + 1) % run.save_every == 0:
            ts = time.perf_counter()
            if pending is not None:                        # the next save waits for the previous one
                pending.finish()
            pending = save_run(runner, run, step + 1, guard, comm, lay, background=run.async_save, staging=staging)
            if not run.async_save:
                saved, pending = pending, None
            record["save_s"] = time.perf_counter() - ts    # what the step waited for (async: the copy)
        history.append(record)
        metrics.write(record)
        bar.update(record, run.log_every)
        if res.stop and step + 1 < run.steps:          # agreed on every rank by the step's allreduce
            bar.close()
            if pending is not None:                        # publish it; it is this step's when just begun
                path = pending.finish()
                saved = path if pending.step == step + 1 else None
                pending = None
            return _stop_on_request(runner, run, step + 1, guard, comm, lay, stop, saved, metrics)
    if pending is not None:
        pending.finish()
    stop.restore()
    bar.close()
    wall = time.perf_counter() - t_start

    # 4. the end: a sample, the merged trace, the summary
    sample = _sample(runner, corpus, model_cfg, run)
    if run.profile:
        events = gather_object(comm, rec.events, root=0)   # timed by comm.timeout
        if rank == 0 and out:
            names = [f"rank {r} (pp, dp, cp, tp) {tuple(Mesh.coords(r, lay.dp, lay.pp, lay.tp, lay.cp))}"
                     for r in range(world)]
            _write_or_warn(out / "trace.json", lambda f: write_chrome_trace(f, events, names))
    if rank == 0 and history:                  # (empty when resumed at the last step)
        summary = _summary(history, val_loss, wall, world, runner.n_params, describe(cfg))
        summary["pp_overlap"] = pp_overlap           # what --pp-overlap (auto: by topology) came to
        summary["memory"] = dict(ledger_predicted=predicted, ledger_rank0=runner.ledger,
                                 peak_rss_max_bytes=history[-1]["peak_rss_max_bytes"],
                                 peak_rss_max_rank=history[-1]["peak_rss_max_rank"],
                                 ledger_peak_max_bytes=history[-1]["ledger_peak_max_bytes"],
                                 ledger_peak_max_rank=history[-1]["ledger_peak_max_rank"])
        _print_summary(summary, sample, out)
        if out:
            _write_or_warn(out / "summary.json", lambda f: f.write_text(json.dumps(summary, indent=1)))
    metrics.close()
    return 0


class MemoryRefused(RuntimeError):
    """--memory-check: some node cannot hold its ranks' predicted peak (agreed by every rank)."""


def _check_memory(mpi, model_cfg, lay, run, optim, predicted: dict) -> None:
    """Refuse, on every rank alike, a run whose ranks on some node are predicted to hold more than
    that node has available: each rank's own ledger peak (its pipeline stage's), summed over the
    node, against ledger.available_memory (read once per node). Collective over the world."""
    from mpi4py import MPI

    pp_rank = Mesh.coords(mpi.Get_rank(), lay.dp, lay.pp, lay.tp, lay.cp).pp
    own = ledger.predict_run(model_cfg, lay, run, optim, pp_rank=pp_rank)["peak"] if lay.pp > 1 else predicted["peak"]
    node = mpi.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local = node.Get_size()
        need = node.allreduce(own, op=MPI.SUM)
        avail = node.bcast(ledger.available_memory() if node.Get_rank() == 0 else None)
        host = MPI.Get_processor_name()
    finally:
        node.Free()
    # the worst node's: the largest need over available (none read: no verdict), the same on every rank
    mine = ((need / avail if avail else float("inf")) if avail is not None else 0.0, need, avail or 0, local, host)
    ratio, need, avail, local, host = mpi.allreduce(mine, op=MPI.MAX)
    if ratio <= 1.0:
        return
    helps = (["fewer sequences per micro-batch (--micro-batch-size, with more --n-micro for the same batch)"]
             * (lay.micro_batch_size > 1)
             + [f"--recompute {'selective or full' if lay.recompute == 'none' else 'full'}"] * (lay.recompute != "full")
             + [f"--zero {lay.zero + 1}{'-3' if lay.zero < 2 else ''}"] * (lay.dp * lay.cp > 1 and lay.zero < 3)
             + ["--dtype bfloat16"] * (run.dtype == "float32")
             + ["more ranks over more nodes"])
    auto = (" (--layout auto plans for a fixed 24 GiB per node: give the sizes python -m pympar.plan chooses for "
            "this node's memory instead)") if run.layout == "auto" else ""
    raise MemoryRefused(
        f"this run needs more memory than node {host} has: its {local} rank(s) are predicted to hold "
        f"{ledger.human(need)} > {ledger.human(avail)} available (the ledger, worst rank: "
        f"{ledger.describe(predicted)}){auto}. Less is held with {', '.join(helps)} (python -m pympar.plan ranks "
        f"the layouts that fit); --no-memory-check runs it anyway")


def _write_or_warn(path, write):
    """A run's last files (summary, trace): a full or failing disk costs the file, with one warning,
    never the finished run's exit status. A link planted in their place is replaced, not written
    through (the run writes inside its --out only)."""
    try:
        if os.path.islink(path):
            os.unlink(path)
        write(path)
    except OSError as e:
        print(f"pympar.train: warning: could not write {path} ({e.strerror or e})", file=sys.stderr, flush=True)


def _stop_on_request(runner, run, next_step, guard, comm, lay, stop, saved, metrics) -> int:
    """Every rank, at the same step: checkpoint (with --out), one line on rank 0, status 75."""
    rank = comm.rank
    why = f"{stop.name} on this rank" if stop.pending else "a signal to another rank"
    if run.out:
        path = saved or save_run(runner, run, next_step, guard, comm, lay)
        msg = (f"pympar.train: stopped on request ({why}) after step {next_step} of {run.steps}: saved {path}; "
               f"resume with the same command and --resume auto (the latest checkpoint under {run.out}/checkpoints)")
    else:
        msg = (f"pympar.train: stopped on request ({why}) after step {next_step} of {run.steps}: nothing could be "
               f"saved (no --out); give --out DIR (with --save-every N) to make a run resumable")
    metrics.close()
    if rank == 0:
        sys.stdout.flush()
        os.write(1, (msg + "\n").encode(errors="backslashreplace"))
    # a second SIGTERM from now on (a scheduler repeating itself) changes nothing, where the default
    # action would end this rank with status 15 instead of 75
    stop.ignore_further()
    return RESUMABLE_STATUS


def _check_gpu(run):
    """ValueError (a clean exit 2) when --device cuda cannot run here."""
    try:
        backend.get_xp("cuda")
    except RuntimeError as e:
        raise ValueError(str(e)) from None
    from . import gpu
    if run.compress == "bf16" and not gpu.bfloat16_supported():
        raise ValueError("--compress bf16 on --device cuda needs a CuPy with bfloat16 arrays (CuPy >= 14 with "
                         "ml_dtypes); use --compress fp16 or none")
    if run.dtype == "bfloat16" and not gpu.bfloat16_supported():
        raise ValueError("--dtype bfloat16 on --device cuda needs a CuPy with bfloat16 arrays (CuPy >= 14 with "
                         "ml_dtypes); use --dtype float16 (loss-scaled) or float32")


def _peak(run, comm) -> float:
    """FLOP/s this rank's MFU is measured against: on a GPU the datasheet's dense bf16 rate of
    the device (pympar.gpu.PEAKS; unknown GPUs: a measured float16 GEMM), on the CPU the
    measured matmul peak in the compute dtype (bf16 products on the bf16 engine, else float32)."""
    if run.device == "cuda":
        from . import gpu
        p = gpu.peak_flops(gpu.device_name(), "bfloat16")
        if p:
            return p
        return measure_matmul_peak(xp=backend.get_xp("cuda"), dtype=np.float16, barrier=comm.barrier)
    return measure_cpu_peak(run.dtype, barrier=comm.barrier)


def _metrics_before(path: Path, start: int) -> list:
    """The records of steps before ``start`` from an earlier run's metrics.jsonl (resume): those
    before a damaged line, with a warning; none from a file that cannot be read (the run goes on)."""
    try:
        if os.path.islink(path):                # not the run's own file: not read (and replaced)
            raise OSError(errno.ELOOP, "a link, not the run's own file")
        rows, bad = read_records(path)
    except FileNotFoundError:
        return []
    except OSError as e:
        rows, bad = [], (None, f"cannot be read ({e.strerror or e})", False)
    kept = [r for r in rows if r["step"] < start]
    if bad:
        line, what, _ = bad
        sys.stderr.write(f"pympar.train: warning: {path}: line {line} {what}; the {len(kept)} record(s) of earlier "
                         f"steps before it are kept\n" if line else
                         f"pympar.train: warning: {path} {what}; its records are lost\n")
        sys.stderr.flush()
    return kept


def _fit_vocab(model_cfg, run, corpus: Corpus):
    """Grow vocab_size to fit the data's token ids unless the user set it (then check it); the first
    token the model could not embed is named by its position (data.Corpus.check_vocab)."""
    if corpus.vocab_size <= model_cfg.vocab_size:
        return model_cfg
    given = "vocab_size" in run.model_overrides
    corpus.check_vocab(model_cfg.vocab_size, given)
    return replace(model_cfg, vocab_size=corpus.vocab_size).validate()


def _sample(runner, corpus, model_cfg, run):
    """A short generation from the trained model (rank 0's text; None elsewhere)."""
    if not run.sample_tokens:
        return None
    prompt_tokens = list(b"def ") if model_cfg.vocab_size == 256 else [int(corpus.val[0])]
    rng = np.random.default_rng(run.seed)
    toks = runner.generate(np.array([prompt_tokens], np.int64), run.sample_tokens, run.sample_top_k, rng)
    if toks is None:
        return None
    toks = [int(t) for t in toks[0]]
    if model_cfg.vocab_size == 256:
        return "".join(chr(t) if 32 <= t < 127 or t in (9, 10) else "?" for t in toks)
    return " ".join(map(str, toks))


_LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpiexec.mpich", "mpirun", "mpirun.mpich", "orterun", "prterun")


def _launcher_on_terminal(levels=4) -> bool:
    """Whether the MPI launcher above this rank writes its output to a terminal.

    A launcher hands its ranks pipes, so the rank's own stdout says nothing; the launcher's
    does. Climb the parent processes (rank -> hydra_pmi_proxy / prted -> mpiexec / mpirun) to
    the first known launcher and look at where its stdout goes: a terminal -> True; a file, a
    pipe (``mpirun ... | tee``), a socket -> False. No launcher found within ``levels``
    parents (srun: the ranks' parent is slurmstepd and srun may be on another node), or /proc
    unreadable -> False: log lines are the safe choice when it cannot be known."""
    from .metrics import process_ancestors

    for pid, name in process_ancestors(os.getppid(), levels):
        if name in _LAUNCHERS:
            try:
                target = os.readlink(f"/proc/{pid}/fd/1")
            except OSError:
                return False
            return target.startswith(("/dev/pts/", "/dev/tty")) and target != "/dev/tty"
    return False


class _progress:
    """Rank 0's view of the loop: a tqdm bar (step, loss, tok/s, MFU) or plain log lines.

    mode 'auto' shows the bar when rank 0's stdout is a terminal, or when the MPI launcher
    above it writes to one (_launcher_on_terminal); log lines otherwise -- a log file, a pipe,
    a batch job, or when it cannot be known.
    """

    def __init__(self, rank, total, mode="auto", launched=False):
        self.rank, self.total, self.bar = rank, total, None
        if mode == "auto":                   # launched: an MPI launcher's variables are set (pympar.config)
            mode = "bar" if sys.stdout.isatty() or (launched and rank == 0 and _launcher_on_terminal()) else "log"
        if rank == 0 and mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5,
                            file=sys.stdout)          # one stream with the log lines: no interleaving

    def update(self, r, log_every):
        if self.rank:
            return
        val = f" val {r['val_loss']:.4f}" if r["val_loss"] is not None else ""
        line = (f"step {r['step'] + 1}/{self.total} loss {r['loss']:.4f}{val} lr {r['lr']:.2e} "
                f"grad_norm {r['grad_norm']:.3f} {r['tokens_per_s']:,.0f} tok/s MFU {100 * r['mfu']:.2f}% "
                f"({1000 * r['step_time']:.0f} ms)")
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {r['loss']:.4f} {r['tokens_per_s']:,.0f} tok/s MFU {100 * r['mfu']:.1f}%",
                                     refresh=False)
            self.bar.update(1)
            if val:                            # validation results stay on screen above the bar
                self.bar.write(line)
        elif r["step"] % log_every == 0 or r["step"] == self.total - 1 or val:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _summary(history, val_loss, wall, world, n_params, config) -> dict:
    steady = history[1:] or history              # the first step pays for warm-up
    split = {k: sum(h["time_split"].get(k, 0.0) for h in steady) for k in SPLIT}
    step_time = sum(h["step_time"] for h in steady)
    return {
        "steps": len(history), "ranks": world, "params": n_params,
        "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"], "val_loss": val_loss,
        "tokens_per_s": statistics.median(h["tokens_per_s"] for h in steady),
        "mfu": statistics.median(h["mfu"] for h in steady),
        "wall_s": wall, "time_fraction": {k: v / step_time for k, v in split.items()} if step_time else {},
        "config": config,
    }


def _print_summary(s, sample, out):
    if sample is not None:
        print("--- sample (top-k) ---\n" + sample + "\n----------------------")
    rows = [("steps", f"{s['steps']}"), ("ranks", f"{s['ranks']}"), ("parameters", f"{s['params']:,}"),
            ("train loss", f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}"),
            ("val loss", f"{s['val_loss']:.4f}" if s["val_loss"] is not None else "-"),
            ("tokens/s (median)", f"{s['tokens_per_s']:,.0f}"), ("MFU (median)", f"{100 * s['mfu']:.2f}%"),
            ("wall time", f"{s['wall_s']:.2f} s")]
    rows += [(f"time in {k}", f"{100 * v:.1f}%") for k, v in s["time_fraction"].items() if v > 0]
    if out:
        rows.append(("output", str(out)))
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows), flush=True)


if __name__ == "__main__":
    sys.exit(main())
