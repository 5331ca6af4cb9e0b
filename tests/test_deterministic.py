"""--deterministic: the same bits for any data-parallel size, split into micro-batches, ZeRO stage
and pipeline schedule.

Real trainer runs under mpiexec on the same global batch (12 micro-batches of 2 sequences, split
as dp x n_micro = 1 x 12, 2 x 6, 3 x 4, 4 x 3) with ZeRO 0-3 spread over them, and pipelines of 2
stages under 1F1B, zb-h1, interleaved and zb-v (alone and with dp = 2 and ZeRO), float32: every
step's loss and gradient norm, and every tensor of the final checkpoint (parameters and AdamW's
moments, reassembled from the ZeRO rows and the stages), must be bitwise the one-process run's.
An elastic restart from 4 ranks to 2 (resumed from the step-2 checkpoint with n_micro doubled)
too. Without --deterministic the same runs differ in the last bits (checked below), so the
comparison can fail.
"""
import json

import numpy as np
import pytest

from mpirun import run_mpi
from pympar.checkpoint import Checkpoint

pytestmark = pytest.mark.mpi

STEPS = 4
ARGS = ["-m", "pympar.train", "--preset", "tiny", "--n-layer", "4", "--block-size", "16", "--micro-batch-size", "2", "--steps", str(STEPS),
        "--eval-every", "0", "--sample-tokens", "0", "--dtype", "float32", "--threads", "1", "--save-every", "2"]
G = 12                                         # micro-batches in the global batch


def _run(out, dp, zero=0, deterministic=True, *extra, pp=1):
    args = [*ARGS, "--n-micro", str(G // dp), "--dp", str(dp), "--zero", str(zero), "--out", str(out), *extra]
    run_mpi(dp * pp, args + (["--deterministic"] if deterministic else []), timeout=180)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (float(r["loss"]).hex(), float(r["grad_norm"]).hex()) for r in rows}


def _tensors(out, step=STEPS):
    ck = Checkpoint(out / "checkpoints" / f"step_{step:08d}")
    return {k: ck.read(k) for k in sorted(ck.tensors)}


def _same_tensors(a, b):
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].shape != b[k].shape or not np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8))]
    assert not bad, bad


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("det") / "dp1"
    return _run(out, 1), _tensors(out)


@pytest.mark.parametrize("dp, zero", [(2, 1), (3, 2), (4, 3), (4, 0)])
def test_every_data_parallel_size_and_zero_stage_gives_the_same_bits(tmp_path, one_process, dp, zero):
    metrics, tensors = one_process
    got = _run(tmp_path / "run", dp, zero)
    assert got == metrics
    _same_tensors(_tensors(tmp_path / "run"), tensors)


@pytest.mark.parametrize("dp, zero, schedule", [(1, 0, "gpipe"), (1, 0, "1f1b"), (1, 0, "zb-h1"), (1, 0, "interleaved"),
                                              (1, 0, "zb-v"), (1, 0, "dualpipev"), (2, 1, "1f1b"), (2, 3, "zb-h1")])
def test_every_pipeline_schedule_gives_the_same_bits(tmp_path, one_process, dp, zero, schedule):
    """pp = 2: each B and W action's weight gradients are terms, the tied embedding's two stages'
    sums are merged as integers, the per-sequence losses summed exactly."""
    metrics, tensors = one_process
    got = _run(tmp_path / "run", dp, zero, True, "--pp", "2", "--schedule", schedule, pp=2)
    assert got == metrics
    _same_tensors(_tensors(tmp_path / "run"), tensors)


def test_an_elastic_restart_from_4_to_2_ranks_gives_the_same_bits(tmp_path, one_process):
    metrics, tensors = one_process
    _run(tmp_path / "four", 4, 1)
    ck = tmp_path / "four" / "checkpoints" / "step_00000002"
    got = _run(tmp_path / "two", 2, 2, True, "--resume", str(ck))
    assert got == {s: metrics[s] for s in range(2, STEPS)}
    _same_tensors(_tensors(tmp_path / "two"), tensors)


def test_without_it_the_bits_differ_and_what_it_cannot_do_is_refused(tmp_path):
    assert _run(tmp_path / "a", 1, deterministic=False) != _run(tmp_path / "b", 4, deterministic=False)
    res = run_mpi(2, [*ARGS, "--tp", "2", "--deterministic", "--out", str(tmp_path / "tp")], timeout=60, check=False)
    assert res.returncode == 2 and "--deterministic makes the step's bits independent of dp" in res.stdout \
        and "tp=2" in res.stdout and "Traceback" not in res.stdout, res.stdout[-2000:]


def test_refusals_name_the_flag_given():
    from pympar.config import ConfigError, parse_args
    with pytest.raises(ConfigError, match=r"--deterministic makes .*; --grad-reduce-dtype bfloat16 would change"):
        parse_args(["--deterministic", "--grad-reduce-dtype", "bfloat16"], world_size=2)
    with pytest.raises(ConfigError, match=r"--deterministic makes .*; --compress topk would change"):
        parse_args(["--deterministic", "--compress", "topk"], world_size=2)


@pytest.mark.slow
def test_eight_ranks_give_the_one_process_bits(tmp_path):
    """dp = 8 (oversubscribing 2 cores) on a global batch of 24 micro-batches, against one process."""
    def run(out, dp, *extra):
        args = [*ARGS, "--n-micro", str(24 // dp), "--dp", str(dp), "--out", str(out), "--deterministic", *extra]
        run_mpi(dp, args, timeout=600)
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    one, eight = run(tmp_path / "one", 1), run(tmp_path / "eight", 8, "--zero", "2")
    assert [(r["loss"], r["grad_norm"]) for r in one] == [(r["loss"], r["grad_norm"]) for r in eight]
    _same_tensors(_tensors(tmp_path / "eight"), _tensors(tmp_path / "one"))


def test_a_non_finite_step_is_skipped_and_stops_as_without_it(tmp_path):
    """A learning rate of 1e30 makes the weights, then the losses, non-finite: the exact sums carry
    NaN (no rank raises), the steps are skipped and the run stops with the trainer's usual status 4
    and message on every rank, as it does without --deterministic."""
    res = run_mpi(2, ["-m", "pympar.train", "--preset", "tiny", "--steps", "8", "--eval-every", "0", "--sample-tokens",
                      "0", "--dtype", "float32", "--lr", "1e30", "--warmup", "0", "--deterministic"],
                  timeout=120, check=False)
    assert res.returncode == 4, res.stdout[-3000:]
    assert res.stdout.count("consecutive steps with non-finite loss or gradients") == 2, res.stdout[-3000:]
    assert "Traceback" not in res.stdout and "MPI_Abort" not in res.stdout, res.stdout[-3000:]
