"""Context parallelism: ring attention and whole training runs under mpiexec (tests/mpi/mpi_cp.py),
the checks that refuse what cannot split, the trainer's --cp."""
import json

import numpy as np
import pytest

from mpirun import run_mpi, run_pytest_mpi
from pympar.config import ConfigError, parse_args
from pympar.nn.config import GPTConfig
from pympar.parallel.cp import local_batch, positions, validate_cp
from pympar.parallel.mesh import Mesh


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_attention_and_training_match_one_process(n):
    run_pytest_mpi(n, "mpi_cp.py", timeout=150)


def test_balanced_split():
    assert positions(8, 2, 0).tolist() == [0, 1, 6, 7] and positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert positions(8, 4, 3).tolist() == [3, 4]
    idx = np.arange(16).reshape(2, 8)
    x, y = local_batch((idx, idx + 1), positions(8, 2, 1))
    assert x.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]] and y.tolist() == [[3, 4, 5, 6], [11, 12, 13, 14]]


def test_mesh_cp_groups():
    g = Mesh.groups(8, dp=2, cp=2, tp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dpcp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    g = Mesh.groups(4, dp=1, cp=4, ep=2)
    assert g["ep"] == [[0, 1], [2, 3]] and g["edp"] == [[0, 2], [1, 3]]
    assert tuple(Mesh.coords(5, dp=2, cp=2, tp=2)) == (0, 1, 0, 1)
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp\*cp=4"):
        Mesh.validate(4, dp=2, cp=2, ep=3)


def test_unsplittable_sequences_are_refused_with_what_would_work():
    with pytest.raises(ValueError, match=r"divisible by 2\*cp = 6.*block_size=8: use cp in \[2, 4\]"):
        validate_cp(GPTConfig(block_size=8), 3)
    with pytest.raises(ValueError, match="too short"):
        validate_cp(GPTConfig(block_size=1), 2)
    with pytest.raises(ValueError, match="block_size / cp must be divisible by tp"):
        validate_cp(GPTConfig(block_size=8, n_head=3, n_embd=48), 2, tp=3, seq_parallel=True)
    validate_cp(GPTConfig(block_size=8), 4)


def test_a2a_ring_groups_are_refused_with_what_would_work():
    cfg = GPTConfig(block_size=16, n_head=4, n_embd=32)
    validate_cp(cfg, 4, comm="a2a+ring", a2a=2)
    with pytest.raises(ValueError, match=r"--cp-a2a must divide cp=4 .* got 4 \(use one of \[2\]\)"):
        validate_cp(cfg, 4, comm="a2a+ring", a2a=4)
    with pytest.raises(ValueError, match=r"cp=2 .* got 2 \(none does here: use --cp-comm ring or a2a\)"):
        validate_cp(cfg, 2, comm="a2a+ring", a2a=2)
    with pytest.raises(ValueError, match=r"divide cp=4 and the 3 head\(s\) of a tp rank .* got 2 \(none does here: "
                                         r"use --cp-comm ring\)"):
        validate_cp(GPTConfig(block_size=16, n_head=6, n_embd=48), 4, tp=2, comm="a2a+ring", a2a=2)
    with pytest.raises(ValueError, match=r"divide cp=6 and the 3 head\(s\) .* got 2 \(use one of \[3\]\)"):
        validate_cp(GPTConfig(block_size=24, n_head=6, n_embd=48), 6, tp=2, comm="a2a+ring", a2a=2)
    with pytest.raises(ValueError, match=r"--cp-a2a 2 sizes the Ulysses groups of --cp-comm a2a\+ring"):
        validate_cp(cfg, 4, comm="ring", a2a=2)
    with pytest.raises(ValueError, match=r"a2a\+ring .* needs --cp 4 or more"):
        validate_cp(cfg, 1, comm="a2a+ring", a2a=2)
    with pytest.raises(ValueError, match=r"--cp-comm a2a splits the heads over the cp ranks: it needs --cp 2 or more"):
        validate_cp(cfg, 1, comm="a2a")


def test_trainer_flag_validation():
    lay = parse_args(["--cp", "2", "--block-size", "32"], 4).parallel
    assert (lay.dp, lay.cp) == (2, 2) and "cp=2" in str(lay)
    with pytest.raises(ConfigError, match=r"divisible by 2\*cp = 6"):
        parse_args(["--cp", "3", "--block-size", "32"], 3)
    with pytest.raises(ConfigError, match=r"not divisible by pp\*cp\*tp=4"):
        parse_args(["--cp", "4", "--block-size", "32"], 6)
    with pytest.raises(ConfigError, match="--layout auto chooses"):
        parse_args(["--cp", "2", "--layout", "auto"], 4)


@pytest.mark.mpi
def test_train_cli_with_cp_matches_one_process(tmp_path):
    """The trainer with --cp 2 (x dp 2) and with one process: the same losses at every step."""
    args = ["-m", "pympar.train", "--steps", "3", "--block-size", "32", "--n-layer", "2", "--n-embd", "32",
            "--n-head", "2", "--micro-batch-size", "2", "--eval-every", "0", "--eval-iters", "2",
            "--sample-tokens", "0", "--log-every", "1", "--progress", "log"]
    run_mpi(1, args + ["--n-micro", "2", "--out", str(tmp_path / "one")], timeout=120)
    four = run_mpi(4, args + ["--cp", "2", "--out", str(tmp_path / "cp")], timeout=120)
    assert "cp=2 (ring)" in four.stdout, four.stdout
    lo = [json.loads(x)["loss"] for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    recs = [json.loads(x) for x in (tmp_path / "cp" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    lc = [r["loss"] for r in recs]
    assert len(lo) == len(lc) == 3
    np.testing.assert_allclose(lc, lo, rtol=2e-5)
    assert all(r["time_split"]["cp_comm"] > 0 for r in recs)      # the ring's waits, in their own category
