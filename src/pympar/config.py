"""Command line and TOML configuration of ``python -m pympar.train``.

Precedence, lowest first: built-in defaults < ``--preset`` < ``--config run.toml`` < flags.
The TOML file uses the flag names with underscores (``micro_batch_size = 4``); keys may
also sit in the configuration tree's tables (``[model]``, ``[parallel]``, ``[optim]``, ``[run]``:
a key in the wrong one is refused, naming its table) or in a table of another name (ignored).
Each value is checked as its flag's is (the field's type, its choices, finite floats; ``_typed_toml``).

``parse_args(argv, world_size)`` returns a ``TrainConfig`` (model, parallel, optim, run) or raises
``ConfigError`` (a ValueError) with a one-line message. It does no communication, so
every rank reaches the same verdict on its own before the first collective.

The environment is read here and nowhere else in the package (``read_environment``; the table
``ENVIRONMENT`` lists every variable and what it sets). ``apply_environment`` hands what it
found to the layers below as explicit settings (kernels, BLAS threads, allocator, communicators);
every application calls it first, and so may a program of its own.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import tomllib
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from . import layout as layouts
from .plan import cost as planner
from .layout import Layout
from .nn.config import PRESETS, GPTConfig
from .optim.config import OptimConfig


class ConfigError(ValueError):
    """A bad configuration: the message says what was wrong and what would be right."""


# --- the environment: read here, passed down as parameters ---------------------------------------
ENVIRONMENT = {   # variable -> what it sets (docs/engine.md, "Environment variables")
    "PYMPAR_NUM_THREADS": "threads per rank when --threads is not given (before OMP_NUM_THREADS)",
    "OMP_NUM_THREADS": "threads per rank when neither --threads nor PYMPAR_NUM_THREADS is given",
    "PYMPAR_COMM_TIMEOUT": "seconds a stalled collective waits (--comm-timeout's default; <= 0: never)",
    "PYMPAR_KERNELS": "'reference': every kernel call runs the pure-NumPy/CuPy reference",
    "PYMPAR_ISA": "'generic', 'avx2' or 'avx512': the C++ kernels of that instruction-set build",
    "PYMPAR_SPIN_US": "microseconds an idle kernel thread spins before it sleeps (default 200)",
    "PYMPAR_BLAS_THREADS": "'own': OpenBLAS keeps its own threads instead of the kernels' pool",
    "PYMPAR_CHUNK_THREADS": "'0': attention's per-slice GEMM stacks run serially",
    "PYMPAR_GEMM": "'numpy': NumPy's BLAS multiplies, 'mkl': Intel MKL must (default 'auto': MKL where installed)",
    "PYMPAR_BF16_GEMM": "'amx' (pympar's AMX kernel), 'avx512bf16' (pympar's AVX512-BF16 kernel), 'mkl' (MKL's "
                        "bf16 GEMM) or 'float32' (widened): what multiplies bf16 (default 'auto': AMX where the "
                        "CPU has it, else pympar's AVX512-BF16 kernel where the CPU has that, else float32)",
    "PYMPAR_MALLOC": "'system': keep glibc's malloc thresholds (freed memory is not retained)",
    "PYMPAR_DEBUG_COLLECTIVES": "'1': check every collective's fingerprint across the ranks",
    "PYMPAR_TUNING": "'measure' (default; pympar.train's: 'reproducible', floating-point reductions over 3+ ranks "
                     "not measured), 'library', or a tuning file of python -m pympar.bench --tune",
    "PYMPAR_SHM_CHUNK": "bytes per chunk of the shared-memory reductions (default 524288)",
    "PYMPAR_CUDA_AWARE_MPI": "'0'/'1': whether MPI reads device memory (default: ask the library)",
    "PYMPAR_RANKS_PER_NODE": "ranks per node the communicators' topology assumes (default: MPI's split)",
    "PYMPAR_PP_CHANNELS": "'0': pipeline sends over MPI with tags, '1': over ordered channels (default: "
                          "channels when the pipeline runs on NCCL)",
    "PYMPAR_NCCL": "'0'/'1': NCCL for GPU collectives (default: when no two ranks share a GPU)",
    "PYMPAR_CACHE": "directory of the tokenised-corpus cache (default ~/.cache/pympar)",
    "PYMPAR_HEARTBEAT_DIR": "(pympar.launch) the folder where every rank's heartbeat thread beats",
    "PYMPAR_HEARTBEAT_INTERVAL": "(pympar.launch) seconds between a rank's heartbeats (default 1)",
    "MPI_LOCALNRANKS, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE":
        "(launchers) ranks on this node: the polling pace before the communicators know it",
    "OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID, LOCAL_RANK, PMI_LOCAL_RANK":
        "(launchers) this rank's index on its node: its GPU",
    "PMI_RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK": "(launchers) started by an MPI launcher (--progress auto)",
}
_LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
_LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK", "PMI_LOCAL_RANK")
_LAUNCHED = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


@dataclass(frozen=True)
class Environment:
    """What the environment says, parsed and checked (``read_environment``)."""
    threads: int = 0                   # 0: not set
    threads_from: str = ""             # the variable it came from
    comm_timeout: float | None = None
    kernels_reference: bool = False
    isa: str = ""
    spin_us: int | None = None
    blas_share_threads: bool = True
    chunk_threads: bool = True
    retain_memory: bool = True
    gemm: str = ""
    bf16_gemm: str = ""
    debug_collectives: bool = False
    tuning: str = ""
    shm_chunk: int | None = None
    cuda_aware_mpi: bool | None = None
    ranks_per_node: int | None = None
    launcher_local_ranks: int | None = None
    pp_channels: str = ""              # "", "0", "1"
    nccl: str = ""                     # "", "0", "1"
    local_rank: int | None = None
    launched: bool = False
    cache_dir: str | None = None
    heartbeat_dir: str | None = None   # set by pympar.launch
    heartbeat_interval: float = 1.0


def _int_var(env, name, low=None):
    v = env.get(name, "").strip()
    if not v:
        return None
    try:
        k = int(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r} is not an integer; unset it or give one") from None
    if low is not None and k < low:
        raise ConfigError(f"{name}={v!r} must be at least {low}")
    return k


def _choice_var(env, name, choices, meaning=None):
    v = env.get(name, "").strip()
    if v not in choices:
        raise ConfigError(f"{name}={v!r}: expected {meaning or 'one of ' + ', '.join(repr(c) for c in choices)}")
    return v


def read_environment(environ=None) -> Environment:
    """The environment (os.environ unless given), parsed; ConfigError naming the variable when a
    value is malformed. Every rank reads the same, so every rank reaches the same verdict."""
    env = os.environ if environ is None else environ
    threads, threads_from = 0, ""
    for var in ("PYMPAR_NUM_THREADS", "OMP_NUM_THREADS"):
        v = env.get(var, "").strip()
        if v:
            try:
                threads = int(v)
            except ValueError:
                raise ConfigError(f"{var}={v!r} is not a number of threads; unset it or give a positive integer") from None
            if threads < 1:
                raise ConfigError(f"{var}={v!r} must be a positive number of threads")
            threads_from = var
            break
    timeout = env.get("PYMPAR_COMM_TIMEOUT", "").strip()
    try:
        timeout = float(timeout) if timeout else None
    except ValueError:
        raise ConfigError(f"PYMPAR_COMM_TIMEOUT={timeout!r} is not a number of seconds") from None
    if timeout is not None and math.isnan(timeout):
        raise ConfigError("PYMPAR_COMM_TIMEOUT=nan is not a number of seconds")
    local_size = next((int(v) for v in (env.get(k, "").split("(")[0].strip() for k in _LOCAL_SIZE) if v.isdigit()),
                      None)
    local_rank = next((int(env[k]) for k in _LOCAL_RANK if env.get(k, "").isdigit()), None)
    aware = _choice_var(env, "PYMPAR_CUDA_AWARE_MPI", ("", "0", "1", "true", "false", "yes", "no")).lower()
    return Environment(
        threads=threads, threads_from=threads_from, comm_timeout=timeout,
        kernels_reference=_choice_var(env, "PYMPAR_KERNELS", ("", "reference", "native")) == "reference",
        isa=_choice_var(env, "PYMPAR_ISA", ("", "generic", "avx2", "avx512")),
        spin_us=_int_var(env, "PYMPAR_SPIN_US", 0),
        blas_share_threads=_choice_var(env, "PYMPAR_BLAS_THREADS", ("", "own", "shared")) != "own",
        chunk_threads=_choice_var(env, "PYMPAR_CHUNK_THREADS", ("", "0", "1")) != "0",
        retain_memory=_choice_var(env, "PYMPAR_MALLOC", ("", "system", "retain")) != "system",
        gemm=_choice_var(env, "PYMPAR_GEMM", ("", "auto", "numpy", "mkl")),
        bf16_gemm=_choice_var(env, "PYMPAR_BF16_GEMM", ("", "auto", "amx", "avx512bf16", "mkl", "float32")),
        debug_collectives=env.get("PYMPAR_DEBUG_COLLECTIVES", "0").strip().lower() not in ("", "0", "false", "no", "off"),
        tuning=env.get("PYMPAR_TUNING", "").strip(),
        shm_chunk=_int_var(env, "PYMPAR_SHM_CHUNK", 64),
        cuda_aware_mpi=None if aware == "" else aware in ("1", "true", "yes"),
        ranks_per_node=_int_var(env, "PYMPAR_RANKS_PER_NODE", 1),
        launcher_local_ranks=local_size,
        pp_channels=_choice_var(env, "PYMPAR_PP_CHANNELS", ("", "0", "1"), "0 (MPI with tags), 1 (ordered channels) "
                                "or unset (channels when the pipeline runs on NCCL)"),
        nccl=_choice_var(env, "PYMPAR_NCCL", ("", "0", "1"), "0 (MPI only), 1 (NCCL) or unset (NCCL unless ranks "
                         "share a GPU)"),
        local_rank=local_rank, launched=any(k in env for k in _LAUNCHED),
        cache_dir=env.get("PYMPAR_CACHE") or None,
        heartbeat_dir=env.get("PYMPAR_HEARTBEAT_DIR") or None, heartbeat_interval=_seconds_var(env, "PYMPAR_HEARTBEAT_INTERVAL", 1.0))


def _seconds_var(env, name, default):
    v = env.get(name, "").strip()
    if not v:
        return default
    try:
        x = float(v)
    except ValueError:
        x = math.nan
    if not x > 0 or math.isinf(x):
        raise ConfigError(f"{name}={v!r} is not a positive number of seconds")
    return x


def apply_environment(environ=None, tuning_default="") -> Environment:
    """read_environment, then hand its settings down: the kernels (reference, instruction set,
    spin), the BLAS threads, the allocator policy and the communicators (pympar.comm.settings).
    tuning_default: auto's setting when $PYMPAR_TUNING is unset ("": measure; the trainer passes
    "reproducible", comm/tuning.py).
    Returns the Environment for what the application itself decides (threads, pipeline channels,
    NCCL, the cache, the local rank)."""
    from . import kernels
    from .comm import progress, settings as comm_settings
    from .kernels import blas, gemm, malloc_policy

    e = read_environment(environ)
    kernels.use_reference(e.kernels_reference)
    try:
        kernels.use_isa(e.isa)
    except ValueError as err:
        raise ConfigError(f"PYMPAR_ISA={e.isa!r}: {err}") from None
    if e.spin_us is not None:
        kernels.set_spin_us(e.spin_us)
    blas.configure(share_threads=e.blas_share_threads, chunk_threads=e.chunk_threads)
    try:
        gemm.use(e.gemm or "auto")
    except ValueError as err:
        raise ConfigError(f"PYMPAR_GEMM={e.gemm}: {err}") from None
    try:
        gemm.use_bf16(e.bf16_gemm or "auto")
    except ValueError as err:
        raise ConfigError(f"PYMPAR_BF16_GEMM={e.bf16_gemm}: {err}") from None
    if e.retain_memory:
        malloc_policy.retain_freed_memory()
    if e.launcher_local_ranks is not None:     # the polling pace before a communicator finds the node's ranks
        progress.note_job_local_ranks(e.launcher_local_ranks)
    comm = dict(debug_collectives=e.debug_collectives, tuning=e.tuning or tuning_default,
                cuda_aware_mpi=e.cuda_aware_mpi, ranks_per_node=e.ranks_per_node)
    if e.comm_timeout is not None:
        comm["timeout"] = e.comm_timeout
    if e.shm_chunk is not None:
        comm["shm_chunk"] = e.shm_chunk
    comm_settings.configure(**comm)
    return e


def start_application(prog: str, timed: bool = False) -> Environment:
    """apply_environment for a command-line program: a malformed variable ends it with
    "prog: error: ..." and status 2 (what argparse does with a bad flag). ``timed``: the program
    reports a speed, so it refuses to run on the reference kernels unless PYMPAR_KERNELS=reference
    asks for them (kernels.require_native)."""
    from . import kernels
    try:
        env = apply_environment()
        if timed:
            kernels.require_native(prog)
        return env
    except (ConfigError, kernels.NativeMissingError) as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        raise SystemExit(2) from None


def child_environment(**extra) -> dict:
    """This process's environment with ``extra`` set: for the processes an application starts."""
    return dict(os.environ, **{k: str(v) for k, v in extra.items()})


@dataclass
class RunConfig:
    """Everything about a run that is not the model's shape, its layout (pympar.layout.Layout) or
    its optimizer (pympar.optim.OptimConfig): data, numerics, communication, output, checkpoints."""
    preset: str = "tiny"
    config: str | None = None
    data: str | None = None
    layout: str = "rule"                 # how the layout's sizes not given are chosen: the rule, or the planner
    ep_dispatch: str = "auto"            # expert parallelism's token exchange: flat alltoallv, or node-aware
    expert_replicas: int = 0             # replica slots per ep rank for the busiest experts
    replan_every: int = 20               # steps between placements of the replicas
    compress: str = "none"
    grad_reduce_dtype: str = "float32"   # bfloat16: the DP gradient reduction in bf16 (= --compress bf16)
    topk_ratio: float = 0.01
    bucket_mb: float = 25.0
    dp_overlap: bool = True
    deterministic: bool = False          # gradients, loss and norm as exact sums: the same bits for any dp
    pp_channels: str = "auto"            # default: $PYMPAR_PP_CHANNELS (0: tags, 1: ordered), else auto
    pp_costs: str = "unit"               # zb-h1/zb-v tables for unit times, or for the first step's measured times
    pp_overlap: str = "auto"             # dualpipev: its F & B pairs interleaved at the ep all-to-alls
    comm_timeout: float = 300.0          # default: $PYMPAR_COMM_TIMEOUT, else 300 s
    # device and numerics
    device: str = "cpu"
    dtype: str = "auto"                  # bfloat16 where the CPU multiplies it natively (and on GPUs), else float32
    master_dtype: str = "float32"
    threads: int = 0
    bind: str = "none"
    memory_check: bool = True            # refuse a run the ledger predicts cannot fit in the nodes' memory
    # the loop
    steps: int = 200
    seed: int = 1337
    # evaluation, output
    eval_every: int = 50
    eval_iters: int = 4
    sample_tokens: int = 200
    sample_top_k: int = 40
    progress: str = "auto"
    log_every: int = 1
    out: str | None = None
    profile: bool = False
    # checkpoints and failures (pympar.resilience)
    save_every: int = 0
    async_save: bool = False
    keep: int = 0
    resume: str | None = None
    max_bad_steps: int = 3
    # resolved by parse_args
    layout_auto: bool = True              # no layout size was given (the start-up line says so)
    model_overrides: list = field(default_factory=list)   # model fields set by the file or flags
    threads_from: str = ""                # where threads came from ("--threads", an env var, or "" = the node)
    dtype_from: str = ""                  # why dtype is what it is when --dtype auto chose it


@dataclass
class TrainConfig:
    """A run's whole configuration, one tree: the model's shape, the parallel layout (the one
    ``Layout``, resolved for the world size), the optimizer, and the rest of the run. The flags
    and the TOML file are flat (``--lr``, ``--tp``); each name belongs to one section."""
    model: GPTConfig
    parallel: Layout
    optim: OptimConfig
    run: RunConfig


_HELP = {
    "preset": "model preset (sets every model field; model flags override it)",
    "config": "TOML file with any of these options (flags override it)",
    "data": "text file, directory of text files, nanoGPT dir (train.bin/val.bin) or llm.c .bin; "
            "default: this Python's standard-library sources",
    "dp": "data-parallel size (default: world / (pp*cp*tp))",
    "cp": "context-parallel size: each sequence's positions split over cp ranks (two of 2*cp equal chunks each; "
          "the attention as --cp-comm says); block_size must be divisible by 2*cp (default 1)",
    "pp": "pipeline-parallel stages (default: 1)", "tp": "tensor-parallel size (default: 1)",
    "ep": "expert-parallel size (divides n_expert, and dp*cp, or dp*cp*tp/etp with --etp below tp; default: 1)",
    "etp": "the experts' tensor-parallel size, a divisor of --tp (default: tp, each expert split like the dense MLP). "
           "Below tp the experts are folded apart from attention's grid: each tp rank runs a 1/(tp/etp) share of its "
           "tokens' expert rows, and --ep may reach over the tp ranks (e.g. 8 ranks: --tp 2 --ep 8 --etp 1, whole "
           "experts, 1/8 of them on each rank; docs/parallel.md)",
    "expert_replicas": "replica slots per ep rank: every --replan-every steps the busiest experts (by the "
                       "tokens they received since the last placement) get copies on the least-loaded ranks and "
                       "their tokens are split among the copies; replicas' gradients are summed into their home "
                       "expert, so the run stays the same run (flat dispatch, tp 1, ZeRO 0-2, no zero-bubble "
                       "schedule; docs/parallel.md)",
    "replan_every": "with --expert-replicas: steps between placements (the first after this many steps)",
    "ep_dispatch": "expert parallelism's token exchange: 'flat' (one alltoallv row per token and chosen expert), "
                   "'node' (each token crosses to a node once and fans out inside it; needs an ep group over "
                   "several nodes with equally many ranks each), 'auto' = node where that holds and top_k > 1, "
                   "else flat (docs/parallel.md)",
    "layout": "'rule': dp/pp/tp/ep/cp not given are filled in (pp=tp=ep=cp=1, dp takes the rest); "
              "'auto': the planner (python -m pympar.plan) picks dp, pp, tp, ep, cp, micro-batches, schedule, "
              "ZeRO, recomputation, sequence parallelism and the cp attention for the same global batch "
              "(micro_batch_size*n_micro*world, re-split into micro-batches); --schedule, --virtual-stages, "
              "--zero, --recompute, --seq-parallel, --cp-comm and --cp-a2a given beside it are kept, the mesh "
              "sizes refused",
    "schedule": "pipeline schedule (zb-h1, zb-v: zero bubble, the backward split into input and weight passes; "
                "dualpipev: DeepSeek's DualPipeV table on zb-v's V, n_micro >= 2*pp; docs/pipeline.md)",
    "virtual_stages": "model chunks per rank (interleaved schedule; zb-v, dualpipev: 2, set for them)",
    "micro_batch_size": "sequences per micro-batch",
    "n_micro": "micro-batches per DP rank per step (global batch = micro_batch_size*n_micro*dp)",
    "zero": "ZeRO stage over the data-parallel group: 1 shards the optimizer state, 2 also the gradients, "
            "3 also the parameters (gathered around each layer's use); 0 = off",
    "recompute": "activation recomputation: 'full' keeps each block's input and recomputes the block in "
                 "backward; 'selective' recomputes the attention probabilities (the T^2 part, which the tiled "
                 "attention kernel, the default on CPU, never keeps) and, without --tp, each dense block's MLP hidden layer "
                 "(4C per token and layer, one more c_fc GEMM; MoE experts keep theirs); 'none' keeps all "
                 "(default: none)",
    "seq_parallel": "sequence parallelism with TP",
    "cp_comm": "context parallelism's attention: 'ring' (key/value blocks around the cp ring) or 'a2a' "
               "(DeepSpeed-Ulysses: an all-to-all to whole sequences of n_head/cp heads and back; needs cp | the "
               "heads of a tp rank) or 'a2a+ring' (Ulysses inside groups of --cp-a2a consecutive cp ranks, the ring "
               "across the groups: Megatron's a2a+p2p)",
    "cp_a2a": "with --cp-comm a2a+ring: ranks per Ulysses group (divides cp, strictly between 1 and cp, divides "
              "the heads of a tp rank)",
    "compress": "gradient compression for the DP allreduce", "topk_ratio": "kept fraction with --compress topk",
    "grad_reduce_dtype": "dtype of the data-parallel gradient reduction: bfloat16 sends bf16 and accumulates in "
                         "float32 inside pympar's reduction (the same as --compress bf16)",
    "bucket_mb": "DP gradient bucket size (MiB)",
    "pp_channels": "pipeline sends: 'ordered' two-rank channels (what NCCL needs), 'tags' (MPI tagged messages), "
                   "'auto': channels when the pipeline runs on NCCL (default: $PYMPAR_PP_CHANNELS 0/1, else auto)",
    "pp_costs": "zb-h1/zb-v: build the table for unit-time F, B, W ('unit'), or from step 2 on for the F, B and W "
                "times of every stage measured in step 1 ('measured': a smaller bubble when they differ; zb-h1's gradients are the "
                "same either way, zb-v's tied embedding gradient may then differ between two runs in its last bits)",
    "pp_overlap": "dualpipev with ep > 1: run each F & B pair of its table interleaved, one micro-batch's expert-parallel "
                  "all-to-alls in flight while the other computes (DeepSeek's overlap; the same bits as 'off'); "
                  "'auto': where the all-to-alls, flat or node-aware, cross nodes (a network moves the bytes while the CPU "
                  "computes; inside a node, measured, they hid 4-13%% of the all-to-all time 1F1B exposes "
                  "and cost up to 3%% of the step)",
    "dp_overlap": "reduce each gradient bucket while backward goes on (--no-dp-overlap: all after backward)",
    "deterministic": "the same bits for any data-parallel size, split into micro-batches and ZeRO stage: every "
                     "sequence's gradient, loss and squared norm is summed exactly (integer bins, comm/exact.py; "
                     "one sequence at a time, slower); with dp, ZeRO and pp (any schedule) only (tp, cp and "
                     "experts split a product's terms: docs/comm.md)",
    "comm_timeout": "seconds before a stalled collective or send/recv aborts the job, naming the ranks that did not "
                    "arrive (default: $PYMPAR_COMM_TIMEOUT, else 300)",
    "device": "cpu or cuda (the GPU path: implemented, not yet run on a GPU)",
    "dtype": "compute dtype (the master weights, gradients and optimizer state are --master-dtype); auto: "
             "bfloat16 where the CPU multiplies bf16 natively (AMX, AVX512-BF16) or on a GPU, else float32",
    "master_dtype": "dtype of the master weights and optimizer state (float64: for checking numerics)",
    "moments_dtype": "AdamW's moments m, v: float32 (the master dtype) or bfloat16 (half their bytes; the update "
                     "still runs in float32, the moments rounded once per step)",
    "threads": "kernel/BLAS threads per rank (0 = $PYMPAR_NUM_THREADS or $OMP_NUM_THREADS if set, else the "
               "cores this node's ranks may run on divided by the ranks on the node)",
    "bind": "'cores': pin each rank's threads to its own disjoint cores of the node's affinity mask (when the "
            "node's ranks share one mask and ranks x threads fit in it); 'none': leave placement to the OS",
    "memory_check": "before building the model, refuse (on every rank) a run whose ranks on some node are predicted "
                    "to hold more (the memory ledger's peak of each rank's pipeline stage, summed) than the node has "
                    "available (MemAvailable, or the least room of the memory cgroups it runs in); "
                    "--no-memory-check runs it anyway (CPU only)",
    "steps": "optimizer steps", "lr": "peak learning rate", "min_lr": "final learning rate of the cosine",
    "warmup": "linear warm-up steps", "weight_decay": "AdamW weight decay", "grad_clip": "global grad-norm clip (0 = off)",
    "seed": "seed of the parameters and of the batch stream",
    "eval_every": "validation loss every N steps (0 = only at the end)", "eval_iters": "validation micro-batches",
    "sample_tokens": "bytes of text to sample at the end (0 = none)", "sample_top_k": "top-k of the sampler",
    "progress": "rank 0 shows a tqdm bar ('bar'), log lines ('log'), or 'auto': the bar when its output "
                "(or the output of mpiexec/mpirun above it) is a terminal, log lines in files, pipes, batch jobs",
    "log_every": "with log lines: one every N steps (and at every validation)",
    "out": "directory for metrics.jsonl, trace.json, summary.json",
    "profile": "record every rank's events; write OUT/trace.json (Chrome trace)",
    "save_every": "checkpoint OUT/checkpoints/step_N every N steps (0 = never)",
    "keep": "keep the newest K checkpoints (0 = all)",
    "async_save": "checkpoints copied to host memory at the end of the step and written by a background thread "
                  "while training goes on; published (atomically, as always) once every rank's file is written",
    "resume": "checkpoint to continue from (a run directory, its checkpoints/ folder or one step_N), "
              "or 'auto' = the latest under OUT/checkpoints if any",
    "max_bad_steps": "stop after this many consecutive steps with non-finite loss/gradients (0 = never)",
}
_CHOICES = {
    "preset": sorted(PRESETS), "schedule": list(layouts.SCHEDULES),
    "compress": ["none", "fp16", "bf16", "topk"], "device": ["cpu", "cuda"], "cp_comm": ["ring", "a2a", "a2a+ring"],
    "ep_dispatch": ["auto", "flat", "node"],
    "grad_reduce_dtype": ["float32", "bfloat16"],
    "dtype": ["auto", "float32", "bfloat16", "float16"], "master_dtype": ["float32", "float64"], "moments_dtype": ["float32", "bfloat16"], "layout": ["rule", "auto"], "zero": [0, 1, 2, 3],
    "progress": ["auto", "bar", "log"], "pp_channels": ["auto", "tags", "ordered"], "pp_costs": ["unit", "measured"], "pp_overlap": ["auto", "on", "off"], "recompute": ["none", "selective", "full"], "bind": ["none", "cores"],
}
_RUN_FIELDS = [f for f in fields(RunConfig) if f.name not in ("layout_auto", "model_overrides",
                                                              "threads_from", "dtype_from")]
_LAYOUT_FIELDS = list(fields(Layout))
_OPTIM_FIELDS = list(fields(OptimConfig))
_MODEL_FIELDS = list(fields(GPTConfig))
# the layout's flags: a mesh size not given is None (filled for the world size: --layout); the
# other fields default to Layout's, except the micro-batch (a Layout's is 1, a run's is 8)
_LAYOUT_FLAG_DEFAULTS = dict(dp=None, pp=None, tp=None, ep=None, cp=None, etp=None, micro_batch_size=8)
MESH_SIZES = ("dp", "pp", "tp", "ep", "etp", "cp")
# what --layout auto chooses with the mesh; a flag of these given beside it pins the planner to it
PLANNED = ("schedule", "virtual_stages", "zero", "seq_parallel", "recompute", "cp_comm", "cp_a2a")


_SECTIONS = {"model": _MODEL_FIELDS, "parallel": _LAYOUT_FIELDS, "optim": _OPTIM_FIELDS, "run": _RUN_FIELDS}


def _layout_flag_default(f):
    return _LAYOUT_FLAG_DEFAULTS.get(f.name, f.default)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def _type_of(f, default):
    t = f.type if not isinstance(f.type, str) else f.type.split("|")[0].strip()
    return {"int": int, "float": float, "str": str, "bool": bool}.get(t, type(default) if default is not None else str)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pympar.train", description="Train a GPT / MoE GPT with pympar on any number of MPI ranks.",
                argument_default=argparse.SUPPRESS)
    run = p.add_argument_group("run")
    for f in _RUN_FIELDS:
        _add(run, f, f.default, _HELP.get(f.name, ""))
    parallel = p.add_argument_group("parallel layout (pympar.layout.Layout)")
    for f in _LAYOUT_FIELDS:
        _add(parallel, f, _layout_flag_default(f), _HELP.get(f.name, ""))
    optim = p.add_argument_group("optimizer (pympar.optim.OptimConfig)")
    for f in _OPTIM_FIELDS:
        _add(optim, f, f.default, _HELP.get(f.name, ""))
    model = p.add_argument_group("model (defaults are the preset's)")
    for f in _MODEL_FIELDS:
        _add(model, f, PRESETS["tiny"].get(f.name, f.default), f"GPTConfig.{f.name}; tiny preset")
    return p


def _add(group, f, default, help):
    flag = "--" + f.name.replace("_", "-")
    t = _type_of(f, default)
    # argument_default=SUPPRESS hides defaults from the namespace; show them in --help anyway
    if "default" not in help:
        help = f"{help} (default: {default})"
    if t is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help)
    else:
        choices = _CHOICES.get(f.name)
        metavar = "{" + ",".join(map(str, choices)) + "}" if choices else f.name.upper()
        group.add_argument(flag, type=t, choices=choices, help=help, metavar=metavar)


def _flatten_toml(d: dict, path: str) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            section = _SECTIONS.get(k)
            for k2, v2 in v.items():
                if isinstance(v2, dict):
                    raise ConfigError(f"{path}: nested table [{k}.{k2}] is not supported; use flat keys or one level of tables")
                name = k2.replace("-", "_")
                if section is not None and name not in {f.name for f in section}:
                    home = next((s for s, fs in _SECTIONS.items() if name in {f.name for f in fs}), None)
                    raise ConfigError(f"{path}: [{k}] has no key {k2!r}" + (f"; it belongs to [{home}]" if home else ""))
                out[k2] = v2
        else:
            out[k] = v
    return {k.replace("-", "_"): v for k, v in out.items()}


def _load_toml(path: str) -> dict:
    try:
        if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
            raise ConfigError(f"--config {path}: not a regular file (a pipe or a device is never read)")
        with open(path, "rb") as f:
            d = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as e:                          # a directory, no permission
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    d = _flatten_toml(d, path)
    known = {f.name for f in (*_RUN_FIELDS, *_LAYOUT_FIELDS, *_OPTIM_FIELDS, *_MODEL_FIELDS)}
    bad = sorted(set(d) - known - {"config"})
    if bad:
        raise ConfigError(f"--config {path}: unknown keys {bad}; every flag name works as a key (underscores)")
    return _typed_toml(d, path)


# floats whose infinity means something (the flag takes ``inf`` too): no time-out
_INFINITY_OK = frozenset({"comm_timeout"})
_KIND = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _toml_value(v) -> str:
    """``v`` as the TOML file spells it (for the error lines), shortened."""
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, str):
        s = json.dumps(v, ensure_ascii=False)
    elif isinstance(v, float) and not math.isfinite(v):
        s = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    elif isinstance(v, (list, tuple)):
        s = "[" + ", ".join(map(_toml_value, v)) + "]"
    elif isinstance(v, dict):
        s = "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    elif hasattr(v, "isoformat"):                  # TOML's dates and times
        s = v.isoformat()
    else:
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _typed_toml(d: dict, path: str) -> dict:
    """The TOML file's values checked as their flags' (``_type_of``, ``_CHOICES``: the same rule
    argparse applies to the flags): int: a TOML integer (not a boolean, not a float); float: an
    integer or a float, finite (not NaN; infinity only where it means something); bool: a boolean;
    str: a string; a field with choices: one of them. A field that defaults to None (``int | None``)
    takes its type. Returns the values as the flags would give them (an integer given for a float,
    a float); ConfigError ``path: key = value: must be ...`` for the first bad one (in the file's
    order, so every rank names the same)."""
    spec = {f.name: f for f in (*_RUN_FIELDS, *_LAYOUT_FIELDS, *_OPTIM_FIELDS, *_MODEL_FIELDS)}
    out = {}
    for k, v in d.items():
        f = spec[k]
        t = _type_of(f, None if f.default is MISSING else f.default)
        choices = _CHOICES.get(k)

        def bad(why, given=_toml_value(v)):
            return ConfigError(f"{path}: {k} = {given}: {why}")
        if t is bool:
            ok = isinstance(v, bool)
        elif t is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif t is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        else:
            ok = isinstance(v, t)
        if not ok:
            raise bad(f"must be {_KIND.get(t, 'a ' + t.__name__)}"
                      + (f" (one of {', '.join(_toml_value(c) for c in choices)})" if choices else ""))
        if t is float:
            try:
                v = float(v)
            except OverflowError:                   # an integer beyond any float
                raise bad("must be a finite number") from None
            if math.isnan(v) or (math.isinf(v) and k not in _INFINITY_OK):
                raise bad("must be a number or inf (inf: no time-out)" if k in _INFINITY_OK else
                          "must be a finite number")
        if choices is not None and v not in choices:
            raise bad(f"must be one of {', '.join(_toml_value(c) for c in choices)}")
        out[k] = v
    return out


def parse_args(argv, world_size: int, env: Environment | None = None) -> TrainConfig:
    """Parse flags (+ TOML), resolve the layout, validate everything; raise ConfigError. ``env``:
    the Environment (read_environment() when not given) for the defaults it sets."""
    env = read_environment() if env is None else env
    ns = vars(build_parser().parse_args(argv))
    given = dict(_load_toml(ns["config"])) if ns.get("config") else {}
    given.update(ns)                                       # flags override the file
    if "comm_timeout" not in given and env.comm_timeout is not None:
        given["comm_timeout"] = env.comm_timeout if env.comm_timeout > 0 else math.inf
    if "pp_channels" not in given and env.pp_channels:
        given["pp_channels"] = {"0": "tags", "1": "ordered"}[env.pp_channels]
    for k, choices in _CHOICES.items():
        if k in given and given[k] not in choices:
            raise ConfigError(f"{k}={given[k]!r} is not one of {choices}")
    run = RunConfig(**{f.name: given[f.name] for f in _RUN_FIELDS if f.name in given})
    optim = OptimConfig(**{f.name: given[f.name] for f in _OPTIM_FIELDS if f.name in given})
    asked = {f.name: given.get(f.name, _layout_flag_default(f)) for f in _LAYOUT_FIELDS}   # the layout as given
    if asked["schedule"] in ("zb-v", "dualpipev") and asked["virtual_stages"] == 1 and (asked["pp"] or 1) > 1:
        asked["virtual_stages"] = 2           # zb-v's and dualpipev's two chunks per rank (the V)
    run.threads_from = "--threads" if run.threads else ""
    if not run.threads and env.threads:
        run.threads, run.threads_from = env.threads, env.threads_from
    if run.grad_reduce_dtype == "bfloat16":                # Megatron's --grad-reduce-in-bf16, spelled as a dtype
        if run.compress not in ("none", "bf16"):
            raise ConfigError(f"grad_reduce_dtype=bfloat16 is --compress bf16; it cannot go with --compress {run.compress}")
        run.compress = "bf16"
    if run.device == "cpu":                               # (on a GPU the trainer asks CuPy: pympar.gpu)
        from .kernels import gemm
        resolve_dtype(run, gemm.bf16_native())
    sections = {f.name for f in (*_RUN_FIELDS, *_LAYOUT_FIELDS, *_OPTIM_FIELDS)}
    overrides = {k: v for k, v in given.items() if k not in sections}
    try:
        model = GPTConfig.from_preset(run.preset, **overrides)
        optim.validate()
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    run.model_overrides = sorted(overrides)
    _check_run(run, optim)
    _check_asked(asked)
    run.layout_auto = all(asked[k] is None for k in MESH_SIZES)
    lay = _planned_layout(world_size, model, run, asked, {k: asked[k] for k in PLANNED if k in given}) \
        if run.layout == "auto" else choose_layout(world_size, model, asked)
    if run.deterministic:
        split = [f"{k}={getattr(lay, k)}" for k in ("tp", "cp", "ep") if getattr(lay, k) > 1]
        if model.n_expert:
            split.append(f"n_expert={model.n_expert}")
        if run.device == "cuda":
            raise ConfigError("--deterministic sums on the host (integer bins over MPI); with --device cuda it is "
                              "not built: drop one of them")
        if split or run.compress != "none":
            lossy = "--grad-reduce-dtype bfloat16" if run.grad_reduce_dtype == "bfloat16" else "--compress " + run.compress
            raise ConfigError(f"--deterministic makes the step's bits independent of dp, the micro-batches and ZeRO; "
                              f"{', '.join(split) or lossy} would change how the terms of a "
                              f"product or a reduction are formed: use dp, pp and --zero only")
    if run.expert_replicas:
        _check_replicas(model, run, lay)
    if run.ep_dispatch == "node" and run.device != "cpu":
        raise ConfigError("--ep-dispatch node runs on the CPU path (host arrays over MPI); with --device cuda "
                          "use auto or flat")
    if run.ep_dispatch == "node" and lay.folded:
        raise ConfigError(f"--ep-dispatch node does not run with the experts folded apart from tp (--etp {lay.etp} < "
                          f"--tp {lay.tp}): use auto or flat")
    if run.pp_costs == "measured" and (lay.pp == 1 or lay.schedule not in ("zb-h1", "zb-v")):
        raise ConfigError(f"--pp-costs measured builds the zb-h1/zb-v table for the measured times, but this run is "
                          f"pp={lay.pp} with schedule {lay.schedule}: use --schedule zb-h1 or zb-v with --pp > 1, or "
                          f"drop --pp-costs")
    if run.pp_overlap == "on" and (lay.pp == 1 or lay.schedule != "dualpipev" or run.device != "cpu" or lay.ep == 1):
        raise ConfigError(f"--pp-overlap on interleaves DualPipeV's F & B pairs on the CPU at their expert-parallel "
                          f"all-to-alls, but this run is pp={lay.pp} ep={lay.ep} with schedule {lay.schedule} on "
                          f"{run.device}: use --schedule dualpipev with --pp > 1, --ep > 1 and --device cpu, or drop "
                          f"--pp-overlap")
    return TrainConfig(model=model, parallel=lay, optim=optim, run=run)


def _check_replicas(model: GPTConfig, run: RunConfig, lay: Layout) -> None:
    """--expert-replicas: what the replicas need (parallel/ep.py), said before any rank communicates."""
    from .parallel.pp.schedules import SPLIT_BACKWARD

    why = []
    if run.expert_replicas < 0 or run.replan_every < 1:
        why.append(f"--expert-replicas {run.expert_replicas} must be >= 0 and --replan-every {run.replan_every} >= 1")
    if not model.n_expert or lay.ep < 2:
        why.append("replicas spread experts over an ep group: give a MoE model and --ep 2 or more")
    elif run.expert_replicas > model.n_expert - model.n_expert // lay.ep:
        why.append(f"a rank can hold one copy of each of the other ranks' {model.n_expert - model.n_expert // lay.ep} "
                   f"experts: --expert-replicas {run.expert_replicas} is more")
    if lay.tp > 1:
        why.append("replicated experts are whole experts: not with --tp")
    if lay.zero == 3:
        why.append("ZeRO-3 shards the experts' weights: use --zero 2 or less")
    if lay.pp > 1 and lay.schedule in SPLIT_BACKWARD:
        why.append(f"{lay.schedule} defers the weight gradients the replicas hand to their homes: use 1f1b or interleaved")
    if run.ep_dispatch == "node":
        why.append("--ep-dispatch node: replicas run on the flat dispatch (use auto or flat)")
    if run.device != "cpu":
        why.append("replicas are built for the CPU path only (--device cpu)")
    if why:
        raise ConfigError("--expert-replicas: " + "; ".join(why))


def resolve_dtype(run: RunConfig, bf16_ok: bool) -> None:
    """--dtype auto made concrete: bfloat16 where ``bf16_ok`` (the CPU multiplies bf16 natively, or
    a GPU holds bf16 arrays), float32 elsewhere and under a float64 master (the numerics oracle);
    run.dtype_from says which. Every rank decides alone, from its own CPU: a job's nodes should be
    alike (the start-up line names the choice)."""
    if run.dtype != "auto":
        return
    if run.master_dtype == "float64":
        run.dtype, run.dtype_from = "float32", "auto: float64 master weights"
    elif bf16_ok:
        run.dtype, run.dtype_from = "bfloat16", "auto: " + ("the GPU" if run.device == "cuda"
                                                             else "this CPU multiplies bf16 natively")
    else:
        run.dtype, run.dtype_from = "float32", "auto: no native bf16 products here"


def _planned_layout(world: int, model: GPTConfig, run: RunConfig, asked: dict, pinned: dict) -> Layout:
    """--layout auto: the planner's best layout for the same global batch (no communication;
    the planner's constants are fixed, so every rank picks the same layout) among those with the
    values ``pinned`` (the PLANNED flags the user gave: --schedule, --zero, --cp-comm, ...)."""
    given = [k for k in MESH_SIZES if asked[k] is not None]
    if given:
        raise ConfigError(f"--layout auto chooses dp, pp, tp, ep, etp and cp itself, but {', '.join('--' + k for k in given)} "
                          f"was given: drop it, or drop --layout auto")
    gb = asked["micro_batch_size"] * asked["n_micro"] * world

    def flag(k, v):
        name = k.replace("_", "-")
        return (f"--{name}" if v else f"--no-{name}") if isinstance(v, bool) else f"--{name} {v}"
    pins = ", ".join(flag(k, v) for k, v in pinned.items())
    others = []

    def accept(lay):                 # (every candidate has passed layouts.check but for the device)
        layouts.check(model, lay, device=run.device)
        if any(getattr(lay, k) != v for k, v in pinned.items()):
            others.append(lay)
            raise ValueError(f"not {pins}")
    try:
        lay = planner.choose(model, world, gb, accept=accept)
    except ValueError as e:
        if others:
            raise ConfigError(f"--layout auto: none of the {len(others)} layouts of {world} rank(s) that run this "
                              f"model and global batch {gb} has {pins}: drop {'them' if len(pinned) > 1 else 'it'}, "
                              f"or give the layout's sizes (--dp, --pp, ...) instead of --layout auto") from None
        raise ConfigError(str(e)) from None
    return lay


def _check_asked(asked: dict) -> None:
    """The layout's flags as numbers (what fill and check cannot say: a size below 1)."""
    for k in (*MESH_SIZES, "micro_batch_size", "n_micro", "virtual_stages"):
        v = asked[k]
        if v is not None and v < 1:
            raise ConfigError(f"{k}={v} must be >= 1")


def _check_run(run: RunConfig, optim: OptimConfig) -> None:
    from . import kernels

    if run.threads > kernels.max_threads():
        raise ConfigError(f"threads={run.threads} ({run.threads_from}) is more than the C++ kernel pool's "
                          f"{kernels.max_threads()} threads per process: give at most {kernels.max_threads()}")
    for k in ("topk_ratio", "bucket_mb"):
        v = getattr(run, k)
        if not math.isfinite(v):
            raise ConfigError(f"{k}={v} must be a finite number")
    if math.isnan(run.comm_timeout):
        raise ConfigError(f"comm_timeout={run.comm_timeout} must be a number of seconds (inf: never time out)")
    if optim.moments_dtype == "bfloat16" and run.master_dtype != "float32":
        raise ConfigError(f"moments_dtype=bfloat16 goes with float32 master weights, not master_dtype={run.master_dtype}")
    if run.out:
        _check_out(run.out)
    for k in ("steps", "eval_iters", "log_every"):
        if getattr(run, k) < 1:
            raise ConfigError(f"{k}={getattr(run, k)} must be >= 1")
    for k in ("eval_every", "sample_tokens", "threads", "seed"):
        if getattr(run, k) < 0:
            raise ConfigError(f"{k}={getattr(run, k)} must be >= 0")
    if run.bucket_mb <= 0:
        raise ConfigError(f"bucket_mb={run.bucket_mb} must be > 0 (MiB per gradient bucket)")
    if run.sample_top_k < 1:
        raise ConfigError(f"sample_top_k={run.sample_top_k} must be >= 1")
    if not 0 < run.topk_ratio <= 1:
        raise ConfigError(f"topk_ratio={run.topk_ratio} must be in (0, 1]")
    if run.comm_timeout <= 0:
        raise ConfigError(f"comm_timeout={run.comm_timeout} must be > 0 seconds")
    for k in ("save_every", "keep", "max_bad_steps"):
        if getattr(run, k) < 0:
            raise ConfigError(f"{k}={getattr(run, k)} must be >= 0")
    if run.save_every and not run.out:
        raise ConfigError(f"--save-every {run.save_every} needs --out DIR (checkpoints go to DIR/checkpoints)")
    if run.resume == "auto" and not run.out:
        raise ConfigError("--resume auto needs --out DIR (it resumes from the latest checkpoint in DIR/checkpoints)")


def check_output_file(path) -> None:
    """ValueError unless ``path`` names a file this process can write (checked, not written): not a
    directory, in an existing folder it may write to."""
    p = Path(path)
    if p.is_dir():
        raise ValueError("is a directory; give a file name")
    parent = p.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot be written: {parent} is not a writable directory")


def _check_out(out: str) -> None:
    """--out must be a directory this process can create or write (checked, not created)."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory; give a directory (it is made when missing)")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == p else f"cannot be made: {probe} is not a writable directory"
        raise ConfigError(f"--out {out}: {what}")
    try:                                # what access() cannot see (root on /sys or /proc, a read-only mount)
        os.rmdir(tempfile.mkdtemp(prefix=".pympar-probe-", dir=probe))
    except OSError as e:
        raise ConfigError(f"--out {out}: {'is not writable' if probe == p else 'cannot be made'} "
                          f"({e.strerror or e})") from None


def choose_layout(world: int, model: GPTConfig, asked: dict) -> Layout:
    """The layout for this world size: the sizes given are kept, the missing ones (None) filled in
    (``pympar.layout.fill``: pp = tp = ep = cp = 1, dp the rest; --layout auto asked the planner
    instead), with the schedule, ZeRO stage, sequence parallelism, recomputation and micro-batches
    as given. Every rank computes the same answer."""
    try:
        return layouts.fill(world, model, **asked)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def describe(cfg: TrainConfig) -> dict:
    """A JSON-able summary of the resolved configuration (for logs and summary.json): the tree."""
    return {"model": asdict(cfg.model), "parallel": asdict(cfg.parallel), "optim": asdict(cfg.optim),
            "run": asdict(cfg.run)}
