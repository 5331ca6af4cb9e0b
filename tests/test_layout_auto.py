"""--layout auto: the planner picks the layout, identically on every rank, for the same global batch."""
import json
from pathlib import Path

import pytest

from mpirun import run_mpi
from pympar.config import ConfigError, parse_args

TINY = ["--preset", "tiny", "--n-layer", "4", "--block-size", "16", "--micro-batch-size", "2", "--n-micro", "2",
        "--sample-tokens", "0", "--eval-every", "0", "--eval-iters", "1"]


def test_parse_keeps_the_global_batch_and_gives_a_runnable_layout():
    model, run = parse_args([*TINY, "--layout", "auto"], world_size=4)
    lay = run.layout_resolved
    assert lay.dp * lay.pp * lay.tp == 4
    assert run.micro_batch_size * run.n_micro * lay.dp == 2 * 2 * 4   # same global batch as the rule's dp=4
    from pympar.parallel.runner import check_supported
    check_supported(model, lay, run)   # raises if the planner chose something the runner cannot run


def test_auto_refuses_explicit_sizes():
    with pytest.raises(ConfigError, match="--layout auto chooses dp, pp, tp, ep and cp itself"):
        parse_args([*TINY, "--layout", "auto", "--tp", "2"], world_size=4)


def test_auto_skips_layouts_the_run_cannot_execute():
    # tensor parallelism needs float32 today (checked by the runner): the planner's pick must respect it
    model, run = parse_args([*TINY, "--layout", "auto", "--dtype", "float16"], world_size=4)
    from pympar.parallel.runner import check_supported
    check_supported(model, run.layout_resolved, run)


def test_cli_runs_the_planned_layout_and_says_so(tmp_path):
    res = run_mpi(4, ["-m", "pympar.train", *TINY, "--layout", "auto", "--steps", "2", "--out", tmp_path,
                      "--progress", "log"], timeout=120)
    assert "chosen by the planner" in res.stdout
    summary = json.loads((Path(tmp_path) / "summary.json").read_text())
    lay = summary["config"]["run"]["layout_resolved"] if "config" in summary else None
    rows = [json.loads(x) for x in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)   # finite, two steps
    if lay:
        assert lay["dp"] * lay["pp"] * lay["tp"] == 4
