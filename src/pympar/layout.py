"""Layouts: how a run is spread over its ranks and whether it can run.

One module owns them (docs/design.md: the configuration layer). A ``Layout`` is the mesh (dp, pp,
tp, ep, cp: ``world = dp * pp * cp * tp``; ep divides dp * cp, or dp * cp * tp / etp with the
experts folded apart from tp, etp < tp: parallel/mesh.py) and what is chosen with it: the
micro-batch size and count, the pipeline schedule and its virtual stages, the ZeRO stage,
sequence parallelism and activation recomputation. The trainer's configuration, the planner
(pympar/plan: which layout to run) and the tests use two functions of it:

- ``check(model, layout)``: every rule a layout must satisfy, raising ``ValueError`` (a
  ``NotSupportedError`` for a combination no strategy implements) with what was wrong and
  what would be right. Pure arithmetic on the model and the layout, so every rank reaches the
  same verdict on its own before any communication. The rules of each strategy stay with the
  strategy (``Mesh.validate``, ``validate_tp``, ``validate_cp``, ``validate_ep``,
  ``validate_pipeline``); this function is the one place that calls them all.
- ``fill(world, model, ...)``: the rule for sizes not given (pp = tp = ep = cp = 1, dp the rest).
"""
from __future__ import annotations

from dataclasses import dataclass

from .nn.config import GPTConfig
from .parallel.cp import validate_cp
from .parallel.ep import validate_ep
from .parallel.mesh import Mesh
from .parallel.pp import schedules as S
from .parallel.pp.partition import validate_pipeline
from .parallel.tp.validate import validate_tp
from .nn.gpt import RECOMPUTE

SCHEDULES = S.SCHEDULES   # the one list (parallel/pp/schedules.py); the CLI offers it
ZERO_STAGES = (0, 1, 2, 3)


class NotSupportedError(ValueError):
    """A combination of strategies that pympar does not implement (the message says what would run)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A run's layout. Mesh sizes first; the rest are chosen with the mesh (the planner) or given
    (the trainer's flags)."""
    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    micro_batch_size: int = 1
    n_micro: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    seq_parallel: bool = False
    recompute: str = "none"
    cp_comm: str = "ring"               # context parallelism's attention: the ring, or Ulysses' all-to-alls
    cp_a2a: int = 0                     # a2a+ring: ranks of a Ulysses group (parallel/cp.py)
    etp: int | None = None              # the experts' tensor parallelism (a divisor of tp; None: tp, unfolded)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def folded(self) -> bool:
        """The experts folded apart from tp: their own tensor parallelism etp < tp (parallel/mesh.py)."""
        return self.etp is not None and self.etp < self.tp

    def __str__(self):
        """The mesh, as the trainer's start-up line prints it."""
        attn = self.cp_comm + (f" in groups of {self.cp_a2a}" if self.cp_comm == "a2a+ring" else "")
        return f"dp={self.dp} pp={self.pp} tp={self.tp} ep={self.ep}" + (f" etp={self.etp}" if self.folded else "") + \
            (f" cp={self.cp} ({attn})" if self.cp > 1 else "")

    def key(self) -> str:
        """Everything, compactly (the planner's table)."""
        s = f"dp{self.dp} pp{self.pp} tp{self.tp} ep{self.ep}" + (f" etp{self.etp}" if self.folded else "") + \
            (f" cp{self.cp}" + (f"-{self.cp_comm}" if self.cp_comm != "ring" else "") +
             (f"{self.cp_a2a}" if self.cp_comm == "a2a+ring" else "") if self.cp > 1 else "") + \
            f" mbs{self.micro_batch_size} m{self.n_micro} {self.schedule}"
        if self.virtual_stages > 1:
            s += f"(v{self.virtual_stages})"
        return s + (f" zero{self.zero}" if self.zero else "") + (" sp" if self.seq_parallel else "") + \
            (f" rc-{self.recompute}" if self.recompute != "none" else "")

    def train_args(self) -> list:
        """The ``python -m pympar.train`` flags that run this layout."""
        a = ["--dp", self.dp, "--pp", self.pp, "--tp", self.tp, "--ep", self.ep] + (["--etp", self.etp] if self.folded else []) + \
            (["--cp", self.cp] if self.cp > 1 else [])
        if self.cp > 1 and self.cp_comm != "ring":
            a += ["--cp-comm", self.cp_comm]
        if self.cp_comm == "a2a+ring":
            a += ["--cp-a2a", self.cp_a2a]
        a += ["--micro-batch-size", self.micro_batch_size, "--n-micro", self.n_micro, "--schedule", self.schedule]
        if self.virtual_stages > 1:
            a += ["--virtual-stages", self.virtual_stages]
        if self.zero:
            a += ["--zero", self.zero]
        if self.seq_parallel:
            a += ["--seq-parallel"]
        if self.recompute != "none":
            a += ["--recompute", self.recompute]
        return [str(x) for x in a]


# --- whether a layout can run ----------------------------------------------------------------
def check(model_cfg: GPTConfig, lay: Layout, *, device: str = "cpu") -> None:
    """Raise ValueError (NotSupportedError for what no strategy implements) when ``lay`` cannot
    train ``model_cfg``; see the module docstring."""
    dp, pp, tp, ep, cp = lay.dp, lay.pp, lay.tp, lay.ep, lay.cp
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: expected cpu or cuda")
    if lay.zero not in ZERO_STAGES:
        raise ValueError(f"zero={lay.zero}: expected a ZeRO stage 0, 1, 2 or 3")
    if lay.recompute not in RECOMPUTE:
        raise ValueError(f"recompute={lay.recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    if lay.schedule not in SCHEDULES:
        raise ValueError(f"schedule={lay.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if lay.micro_batch_size < 1 or lay.n_micro < 1:
        raise ValueError(f"micro_batch_size={lay.micro_batch_size} and n_micro={lay.n_micro} must be >= 1")
    if lay.seq_parallel and tp == 1:
        raise NotSupportedError("--seq-parallel splits activations over the tensor-parallel group: it needs --tp > 1")
    Mesh.validate(lay.world, dp, pp, tp, ep, cp, lay.etp)
    validate_ep(model_cfg, ep)
    if lay.folded and not model_cfg.n_expert:
        raise ValueError(f"etp={lay.etp} folds experts apart from tp: it needs a MoE model (n_expert > 0)")
    if tp > 1:
        validate_tp(model_cfg, tp, lay.seq_parallel, seq_len=model_cfg.block_size // cp)
    validate_cp(model_cfg, cp, tp, lay.seq_parallel, comm=lay.cp_comm, a2a=lay.cp_a2a)
    v = lay.virtual_stages
    if pp > 1:
        validate_pipeline(model_cfg, pp, lay.n_micro, lay.schedule, v)
    elif v != 1:
        raise ValueError(f"virtual_stages={v} needs a pipeline: use --pp > 1 with --schedule interleaved, zb-v or dualpipev, or 1")


def fill(world: int, model: GPTConfig, *, dp=None, pp=None, tp=None, ep=None, cp=None, seq_parallel=False,
         etp=None, **rest) -> Layout:
    """The layout of ``world`` ranks with the sizes given kept and the missing ones filled in:
    pp = tp = ep = cp = 1 unless given, dp the rest of the world. ``rest``: the other Layout
    fields, taken as they are. Raises ValueError for sizes that do not fit the world or the model."""
    pp, tp, ep, cp = pp or 1, tp or 1, ep or 1, cp or 1
    others, names = pp * cp * tp, "pp*tp" if cp == 1 else "pp*cp*tp"
    if dp is None:
        if world % others:
            raise ValueError(f"world size {world} is not divisible by {names}={others}; "
                             f"launch a multiple of {others} ranks or change --{names.replace('*', '/--')}")
        dp = world // others
    if dp * others != world:
        sizes = "*".join(str(x) for x in ((dp, pp, tp) if cp == 1 else (dp, pp, cp, tp)))
        raise ValueError(f"dp*{names} = {sizes} = {dp * others} does not match the world size {world}; "
                         f"launch {dp * others} ranks or change the layout")
    Mesh.validate(world, dp, pp, tp, ep, cp, etp)      # ep (and etp) against the mesh
    if cp > 1:
        validate_cp(model, cp, tp, seq_parallel)
    validate_ep(model, ep)
    if tp > 1 and model.n_head % tp:
        raise ValueError(f"n_head={model.n_head} is not divisible by tp={tp}")
    if pp > model.n_layer:
        raise ValueError(f"pp={pp} is more than n_layer={model.n_layer}: every stage needs at least one block")
    return Layout(dp=dp, pp=pp, tp=tp, ep=ep, cp=cp, seq_parallel=seq_parallel, etp=etp, **rest)
