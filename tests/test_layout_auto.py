"""--layout auto: the planner picks the layout, identically on every rank, for the same global batch."""
import dataclasses
import json
import math
from pathlib import Path

import pytest

from mpirun import run_mpi
from pympar import layout as layouts
from pympar.plan import cost as planner
from pympar.config import ConfigError, parse_args

TINY = ["--preset", "tiny", "--n-layer", "4", "--block-size", "16", "--micro-batch-size", "2", "--n-micro", "2",
        "--sample-tokens", "0", "--eval-every", "0", "--eval-iters", "1"]


def test_parse_takes_the_planners_best_layout_for_the_same_global_batch():
    """parse_args --layout auto = the fastest prediction of the planner that pympar.layout.check
    accepts, the rule's global batch kept; the configuration's one Layout is the planner's."""
    c = parse_args([*TINY, "--layout", "auto"], world_size=4)
    model, lay = c.model, c.parallel
    preds, _ = planner.plan(model, 4, 2 * 2 * 4, _fixed_machine(4))
    assert preds and lay == preds[0].layout                # the first of the sorted predictions
    assert lay.world == 4
    assert lay.micro_batch_size * lay.n_micro * lay.dp == 2 * 2 * 4   # same global batch as the rule's dp=4
    assert parse_args([*TINY, "--layout", "auto"], world_size=4).parallel == lay   # every rank the same


def _fixed_machine(world):
    return planner.fixed_machine(world)           # the constants planner.choose uses (no measurement)


def test_auto_refuses_explicit_sizes():
    with pytest.raises(ConfigError, match="--layout auto chooses dp, pp, tp, ep, etp and cp itself"):
        parse_args([*TINY, "--layout", "auto", "--tp", "2"], world_size=4)


def test_auto_keeps_the_planned_flags_given_beside_it():
    """--schedule, --zero, --recompute, --cp-comm ... given with --layout auto pin the planner to them
    (the best planned layout that has them), where they were once dropped for the planner's own;
    none that has them: one clear error naming them."""
    free = parse_args([*TINY, "--layout", "auto"], world_size=4).parallel
    for argv, want in ((["--zero", "2"], dict(zero=2)), (["--schedule", "zb-v"], dict(schedule="zb-v")),
                       (["--recompute", "full", "--zero", "1"], dict(recompute="full", zero=1)),
                       (["--n-head", "4", "--cp-comm", "a2a"], dict(cp_comm="a2a"))):
        lay = parse_args([*TINY, "--layout", "auto", *argv], world_size=4).parallel
        assert all(getattr(lay, k) == v for k, v in want.items()) and lay.world == 4, (argv, lay)
        assert any(getattr(free, k) != v for k, v in want.items())        # a pin that changed the plan
        model = parse_args([*TINY, *argv[:2]] if argv[0] == "--n-head" else TINY, world_size=4).model
        preds, _ = planner.plan(model, 4, 16, _fixed_machine(4))
        assert lay == next(p.layout for p in preds if all(getattr(p.layout, k) == v for k, v in want.items()))
    with pytest.raises(ConfigError, match=r"none of the \d+ layouts of 2 rank\(s\) .* has --schedule dualpipev: drop it"):
        parse_args([*TINY, "--n-layer", "2", "--layout", "auto", "--schedule", "dualpipev"], world_size=2)
    with pytest.raises(ConfigError, match=r"has --zero 1, --seq-parallel: drop them"):       # flags as typed
        parse_args([*TINY, "--layout", "auto", "--seq-parallel", "--zero", "1"], world_size=1)


def test_choose_skips_what_accept_refuses_and_takes_the_next_best():
    model = parse_args(TINY, world_size=4).model
    best = planner.choose(model, 4, 16)

    def no(lay):
        if lay.pp == best.pp and lay.tp == best.tp:
            raise ValueError("not this shape")
    other = planner.choose(model, 4, 16, accept=no)
    assert (other.pp, other.tp) != (best.pp, best.tp)
    preds, _ = planner.plan(model, 4, 16, _fixed_machine(4))
    assert other == next(p.layout for p in preds if (p.layout.pp, p.layout.tp) != (best.pp, best.tp))
    with pytest.raises(ValueError, match="no valid layout of 4 ranks"):
        planner.choose(model, 4, 16, accept=lambda lay: (_ for _ in ()).throw(ValueError("none")))


def test_cli_runs_the_planned_layout_and_says_so(tmp_path):
    res = run_mpi(4, ["-m", "pympar.train", *TINY, "--layout", "auto", "--steps", "2", "--out", tmp_path,
                      "--progress", "log"], timeout=120)
    assert "chosen by the planner" in res.stdout
    summary = json.loads((Path(tmp_path) / "summary.json").read_text())
    lay = summary["config"]["parallel"]
    assert lay == dataclasses.asdict(parse_args([*TINY, "--layout", "auto"], world_size=4).parallel)            # what the ranks ran is the plan
    rows = [json.loads(x) for x in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_check_refuses_what_no_strategy_implements_with_what_would_run():
    model = parse_args(TINY, world_size=4).model
    zb3 = layouts.Layout(dp=2, pp=2, n_micro=2, schedule="zb-h1", zero=3)
    for zero in (0, 1, 2, 3):                                      # every ZeRO stage composes with zero bubble
        layouts.check(model, dataclasses.replace(zb3, zero=zero))
    layouts.check(model, dataclasses.replace(zb3, schedule="1f1b"))
    with pytest.raises(layouts.NotSupportedError, match="--seq-parallel .* needs --tp > 1"):
        layouts.check(model, layouts.Layout(dp=4, seq_parallel=True))
    with pytest.raises(ValueError, match="virtual_stages=2 needs a pipeline"):
        layouts.check(model, layouts.Layout(dp=4, virtual_stages=2))


def test_pp_overlap_on_needs_what_it_overlaps():
    """--pp-overlap on interleaves DualPipeV's pairs at the ep all-to-alls: refused without them
    (ep 1), as without dualpipev; accepted with ep > 1."""
    dual = [*TINY, "--pp", "2", "--schedule", "dualpipev", "--n-micro", "4", "--pp-overlap", "on"]
    with pytest.raises(ConfigError, match=r"this run is pp=2 ep=1 with schedule dualpipev .* --ep > 1"):
        parse_args(dual, world_size=2)
    with pytest.raises(ConfigError, match=r"this run is pp=1 ep=1 with schedule 1f1b"):
        parse_args([*TINY, "--pp-overlap", "on"], world_size=2)
    lay = parse_args([*dual, "--preset", "moe-tiny", "--ep", "2"], world_size=4).parallel
    assert (lay.pp, lay.ep, lay.schedule) == (2, 2, "dualpipev")
