"""Command line and TOML configuration of ``python -m pympar.train``.

Precedence, lowest first: built-in defaults < ``--preset`` < ``--config run.toml`` < flags.
The TOML file uses the flag names with underscores (``micro_batch_size = 4``); keys may
also sit in tables (``[model]``, ``[parallel]``, ``[train]``: the table name is ignored).

``parse_args(argv, world_size)`` returns ``(GPTConfig, RunConfig)`` or raises
``ConfigError`` (a ValueError) with a one-line message. It does no communication, so
every rank reaches the same verdict on its own before the first collective.
"""
from __future__ import annotations

import argparse
import math
import os
import tomllib
from dataclasses import replace, asdict, dataclass, field, fields
from pathlib import Path

from .nn.config import PRESETS, GPTConfig


class ConfigError(ValueError):
    """A bad configuration: the message says what was wrong and what would be right."""


@dataclass
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    def __str__(self):
        return f"dp={self.dp} pp={self.pp} tp={self.tp} ep={self.ep}" + (f" cp={self.cp}" if self.cp > 1 else "")


@dataclass
class RunConfig:
    """Everything about a run that is not the model's shape."""
    preset: str = "tiny"
    config: str | None = None
    data: str | None = None
    # parallel layout (None = chosen for the world size)
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    ep: int | None = None
    cp: int | None = None
    layout: str = "rule"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch_size: int = 8
    n_micro: int = 1
    zero: int = 0
    recompute: str = "none"
    seq_parallel: bool = False
    compress: str = "none"
    topk_ratio: float = 0.01
    bucket_mb: float = 25.0
    comm_timeout: float = 300.0          # default: $PYMPAR_COMM_TIMEOUT, else 300 s
    # device and numerics
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0
    bind: str = "none"
    # optimisation
    steps: int = 200
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
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
    # checkpoints and failures (pympar.faults)
    save_every: int = 0
    async_save: bool = False
    keep: int = 0
    resume: str | None = None
    max_bad_steps: int = 3
    # resolved by parse_args
    layout_resolved: Layout = field(default_factory=Layout)
    layout_auto: bool = True
    model_overrides: list = field(default_factory=list)   # model fields set by the file or flags
    threads_from: str = ""                # where threads came from ("--threads", an env var, or "" = the node)


_HELP = {
    "preset": "model preset (sets every model field; model flags override it)",
    "config": "TOML file with any of these options (flags override it)",
    "data": "text file, directory of text files, nanoGPT dir (train.bin/val.bin) or llm.c .bin; "
            "default: this Python's standard-library sources",
    "dp": "data-parallel size (default: world / (pp*cp*tp))",
    "cp": "context-parallel size: each sequence's positions split over cp ranks (two of 2*cp equal chunks each, "
          "ring attention); block_size must be divisible by 2*cp (default 1)",
    "pp": "pipeline-parallel stages", "tp": "tensor-parallel size",
    "ep": "expert-parallel size (divides dp*cp and n_expert)",
    "layout": "'rule': dp/pp/tp/ep/cp not given are filled in (pp=tp=ep=cp=1, dp takes the rest); "
              "'auto': the planner (python -m pympar.plan) picks dp, pp, tp, ep, cp, micro-batches, schedule, "
              "ZeRO and sequence parallelism for the same global batch (micro_batch_size*n_micro*world)",
    "schedule": "pipeline schedule (zb-h1, zb-v: zero bubble, the backward split into input and weight passes; "
                "docs/pipeline.md)",
    "virtual_stages": "model chunks per rank (interleaved schedule; zb-v: 2, set for it)",
    "micro_batch_size": "sequences per micro-batch",
    "n_micro": "micro-batches per DP rank per step (global batch = micro_batch_size*n_micro*dp)",
    "zero": "ZeRO stage over the data-parallel group: 1 shards the optimizer state, 2 also the gradients, "
            "3 also the parameters (gathered around each layer's use); 0 = off",
    "recompute": "activation recomputation: 'full' keeps each block's input and recomputes the block in "
                 "backward, 'selective' recomputes the attention probabilities (the T^2 part; the tiled attention "
                 "kernel, the default on CPU, never keeps them, so there it equals 'none'), 'none' keeps all",
    "seq_parallel": "sequence parallelism with TP",
    "compress": "gradient compression for the DP allreduce", "topk_ratio": "kept fraction with --compress topk",
    "bucket_mb": "DP gradient bucket size (MiB)",
    "comm_timeout": "seconds before a stalled collective or send/recv aborts the job, naming the ranks that did not "
                    "arrive (default: $PYMPAR_COMM_TIMEOUT, else 300)",
    "device": "cpu or cuda", "dtype": "compute dtype (master weights stay float32)",
    "threads": "kernel/BLAS threads per rank (0 = $PYMPAR_NUM_THREADS or $OMP_NUM_THREADS if set, else the "
               "cores this node's ranks may run on divided by the ranks on the node)",
    "bind": "'cores': pin each rank's threads to its own disjoint cores of the node's affinity mask (when the "
            "node's ranks share one mask and ranks x threads fit in it); 'none': leave placement to the OS",
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
    "preset": sorted(PRESETS), "schedule": ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"],
    "compress": ["none", "fp16", "bf16", "topk"], "device": ["cpu", "cuda"],
    "dtype": ["float32", "bfloat16", "float16"], "layout": ["rule", "auto"], "zero": [0, 1, 2, 3],
    "progress": ["auto", "bar", "log"], "recompute": ["none", "selective", "full"], "bind": ["none", "cores"],
}
_RUN_FIELDS = [f for f in fields(RunConfig) if f.name not in ("layout_resolved", "layout_auto", "model_overrides",
                                                              "threads_from")]
_MODEL_FIELDS = list(fields(GPTConfig))


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
            for k2, v2 in v.items():
                if isinstance(v2, dict):
                    raise ConfigError(f"{path}: nested table [{k}.{k2}] is not supported; use flat keys or one level of tables")
                out[k2] = v2
        else:
            out[k] = v
    return {k.replace("-", "_"): v for k, v in out.items()}


def _load_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            d = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    d = _flatten_toml(d, path)
    known = {f.name for f in _RUN_FIELDS} | {f.name for f in _MODEL_FIELDS}
    bad = sorted(set(d) - known - {"config"})
    if bad:
        raise ConfigError(f"--config {path}: unknown keys {bad}; every flag name works as a key (underscores)")
    return d


def parse_args(argv, world_size: int) -> tuple[GPTConfig, RunConfig]:
    """Parse flags (+ TOML), resolve the layout, validate everything; raise ConfigError."""
    ns = vars(build_parser().parse_args(argv))
    given = dict(_load_toml(ns["config"])) if ns.get("config") else {}
    given.update(ns)                                       # flags override the file
    if "comm_timeout" not in given and os.environ.get("PYMPAR_COMM_TIMEOUT"):
        try:
            given["comm_timeout"] = float(os.environ["PYMPAR_COMM_TIMEOUT"])
        except ValueError:
            raise ConfigError(f"PYMPAR_COMM_TIMEOUT={os.environ['PYMPAR_COMM_TIMEOUT']!r} is not a number of seconds") from None
    run_names = {f.name for f in _RUN_FIELDS}
    run = RunConfig(**{k: v for k, v in given.items() if k in run_names})
    run.threads_from = "--threads" if run.threads else ""
    if run.schedule == "zb-v" and run.virtual_stages == 1 and (run.pp or 1) > 1:
        run.virtual_stages = 2                # zb-v's two chunks per rank (the V)
    if not run.threads:                   # the environment, read here at the edge
        for var in ("PYMPAR_NUM_THREADS", "OMP_NUM_THREADS"):
            v = os.environ.get(var, "").strip()
            if v:
                try:
                    run.threads = int(v)
                except ValueError:
                    raise ConfigError(f"{var}={v!r} is not a number of threads; unset it or give a positive integer") from None
                if run.threads < 1:
                    raise ConfigError(f"{var}={v!r} must be a positive number of threads")
                run.threads_from = var
                break
    for k in ("schedule", "compress", "device", "dtype", "preset", "zero", "layout", "recompute"):
        if getattr(run, k) not in _CHOICES[k]:
            raise ConfigError(f"{k}={getattr(run, k)!r} is not one of {_CHOICES[k]}")
    overrides = {k: v for k, v in given.items() if k not in run_names}
    try:
        model = GPTConfig.from_preset(run.preset, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    run.model_overrides = sorted(overrides)
    _check_run(run)
    run.layout_auto = all(getattr(run, k) is None for k in ("dp", "pp", "tp", "ep", "cp"))
    if run.layout == "auto":
        _apply_planner(world_size, model, run)
    run.layout_resolved = choose_layout(world_size, model, run)
    return model, run


def _apply_planner(world: int, model: GPTConfig, run: RunConfig) -> None:
    """--layout auto: the planner's best layout for the same global batch (no communication;
    the planner's constants are fixed, so every rank picks the same layout)."""
    given = [k for k in ("dp", "pp", "tp", "ep", "cp") if getattr(run, k) is not None]
    if given:
        raise ConfigError(f"--layout auto chooses dp, pp, tp, ep and cp itself, but {', '.join('--' + k for k in given)} "
                          f"was given: drop it, or drop --layout auto")
    from .parallel.runner import check_supported
    from .plan import choose_layout as plan_layout

    def accept(lay):          # only layouts this run's options can execute
        opts = replace(run, micro_batch_size=lay.micro_batch_size, n_micro=lay.n_micro, schedule=lay.schedule,
                       virtual_stages=lay.virtual_stages, zero=int(lay.zero), seq_parallel=lay.seq_parallel,
                       recompute=lay.recompute)
        check_supported(model, Layout(lay.dp, lay.pp, lay.tp, lay.ep, lay.cp), opts)

    gb = run.micro_batch_size * run.n_micro * world
    try:
        lay = plan_layout(model, world, gb, accept=accept)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    run.dp, run.pp, run.tp, run.ep, run.cp = lay.dp, lay.pp, lay.tp, lay.ep, lay.cp
    run.micro_batch_size, run.n_micro = lay.micro_batch_size, lay.n_micro
    run.schedule, run.virtual_stages = lay.schedule, lay.virtual_stages
    run.zero, run.seq_parallel, run.recompute = int(lay.zero), lay.seq_parallel, lay.recompute


def _check_run(run: RunConfig) -> None:
    for k in ("lr", "min_lr", "weight_decay", "grad_clip", "topk_ratio", "bucket_mb"):
        v = getattr(run, k)
        if not math.isfinite(v):
            raise ConfigError(f"{k}={v} must be a finite number")
    if math.isnan(run.comm_timeout):
        raise ConfigError(f"comm_timeout={run.comm_timeout} must be a number of seconds (inf: never time out)")
    if run.out:
        _check_out(run.out)
    positive = ("micro_batch_size", "n_micro", "steps", "virtual_stages", "eval_iters", "log_every")
    for k in positive:
        if getattr(run, k) < 1:
            raise ConfigError(f"{k}={getattr(run, k)} must be >= 1")
    for k in ("lr", "min_lr", "warmup", "weight_decay", "grad_clip", "eval_every", "sample_tokens",
              "threads", "bucket_mb"):
        if getattr(run, k) < 0:
            raise ConfigError(f"{k}={getattr(run, k)} must be >= 0")
    if run.min_lr > run.lr:
        raise ConfigError(f"min_lr={run.min_lr} is above lr={run.lr}")
    if not 0 < run.topk_ratio <= 1:
        raise ConfigError(f"topk_ratio={run.topk_ratio} must be in (0, 1]")
    if run.comm_timeout <= 0:
        raise ConfigError(f"comm_timeout={run.comm_timeout} must be > 0 seconds")
    for k in ("dp", "pp", "tp", "ep", "cp"):
        v = getattr(run, k)
        if v is not None and v < 1:
            raise ConfigError(f"{k}={v} must be >= 1")
    for k in ("save_every", "keep", "max_bad_steps"):
        if getattr(run, k) < 0:
            raise ConfigError(f"{k}={getattr(run, k)} must be >= 0")
    if run.save_every and not run.out:
        raise ConfigError(f"--save-every {run.save_every} needs --out DIR (checkpoints go to DIR/checkpoints)")
    if run.resume == "auto" and not run.out:
        raise ConfigError("--resume auto needs --out DIR (it resumes from the latest checkpoint in DIR/checkpoints)")


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


def choose_layout(world: int, model: GPTConfig, run: RunConfig) -> Layout:
    """The layout for this world size. Given sizes are kept; missing ones are filled in.

    Rule: pp = tp = ep = cp = 1 unless given, and dp takes the rest of the world (--layout auto asks
    the planner instead). Every rank computes the same answer.
    """
    pp, tp, ep, cp = run.pp or 1, run.tp or 1, run.ep or 1, run.cp or 1
    rest, names = pp * cp * tp, "pp*tp" if cp == 1 else "pp*cp*tp"
    if run.dp is None:
        if world % rest:
            raise ConfigError(f"world size {world} is not divisible by {names}={rest}; "
                              f"launch a multiple of {rest} ranks or change --{names.replace('*', '/--')}")
        dp = world // rest
    else:
        dp = run.dp
    lay = Layout(dp, pp, tp, ep, cp)
    if dp * rest != world:
        raise ConfigError(f"dp*{names} = {dp}*{rest} = {dp * rest} does not match the world size {world}; "
                          f"launch {dp * rest} ranks or change the layout")
    if (dp * cp) % ep:
        raise ConfigError(f"ep={ep} does not divide dp*cp={dp * cp} (experts are sharded over the data- and "
                          f"context-parallel ranks)" if cp > 1 else
                          f"ep={ep} does not divide dp={dp} (experts are sharded over data-parallel ranks)")
    if cp > 1:
        from .parallel.cp import validate_cp
        try:
            validate_cp(model, cp, tp, run.seq_parallel)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if ep > 1 and (model.n_expert == 0 or model.n_expert % ep):
        raise ConfigError(f"ep={ep} needs n_expert divisible by ep; n_expert={model.n_expert}")
    if tp > 1 and model.n_head % tp:
        raise ConfigError(f"n_head={model.n_head} is not divisible by tp={tp}")
    if pp > model.n_layer:
        raise ConfigError(f"pp={pp} is more than n_layer={model.n_layer}: every stage needs at least one block")
    return lay


def describe(model: GPTConfig, run: RunConfig) -> dict:
    """A JSON-able summary of the resolved configuration (for logs and summary.json)."""
    r = asdict(run)
    r["layout_resolved"] = asdict(run.layout_resolved)
    return {"model": {f.name: getattr(model, f.name) for f in _MODEL_FIELDS}, "run": r}

