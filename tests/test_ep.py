"""Expert parallelism under mpiexec (tests/mpi/mpi_ep.py): dp = n with every ep | gcd(n, n_expert),
against the single-process run; plus the pure helpers in this process."""
import numpy as np
import pytest

from mpirun import run_mpi, run_pytest_mpi
from pympar.nn.config import GPTConfig
from pympar.parallel.ep import expert_range, validate_ep


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_ep_matches_single_process(n):
    run_pytest_mpi(n, "mpi_ep.py", timeout=80)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3, 8])
def test_ep_matches_single_process_other_sizes(n):
    run_pytest_mpi(n, "mpi_ep.py", timeout=240)


@pytest.mark.mpi
@pytest.mark.parametrize("n,env", [(4, {"PYMPAR_RANKS_PER_NODE": 2}), (4, {"MPIR_CVAR_NUM_CLIQUES": 2}),
                                   (2, {"PYMPAR_RANKS_PER_NODE": 1})], ids=["2x2-shm", "2x2-cliques", "2x1"])
def test_node_aware_dispatch(n, env):
    """The two-hop route and the model with it (tests/mpi/mpi_ep_node.py): 2 nodes of 2 ranks,
    simulated by pympar (all shared memory) and by MPICH's cliques (network between them), and 2
    nodes of one rank (the second hop is the rank itself)."""
    run_pytest_mpi(n, "mpi_ep_node.py", timeout=90, env=env)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n,env", [(6, {"PYMPAR_RANKS_PER_NODE": 2}),
                                   (4, {"PYMPAR_RANKS_PER_NODE": 2, "MPIR_CVAR_NOLOCAL": 1}),
                                   (8, {"PYMPAR_RANKS_PER_NODE": 4}), (3, {"PYMPAR_RANKS_PER_NODE": 1})])
def test_node_aware_dispatch_other_topologies(n, env):
    run_pytest_mpi(n, "mpi_ep_node.py", timeout=240, env=env)


@pytest.mark.mpi
def test_trainer_node_dispatch_on_one_node_is_an_error_on_every_rank(tmp_path):
    """--ep-dispatch node where the ep group is on one node: the same one-line error on every rank,
    exit 2, no traceback (the ranks agree on it after building their routes)."""
    p = run_mpi(2, ["-m", "pympar.train", "--preset", "moe-tiny", "--ep", "2", "--ep-dispatch", "node",
                    "--steps", "1", "--out", tmp_path], timeout=90, check=False)
    assert p.returncode == 2, p.stdout[-3000:]
    assert p.stdout.count("pympar.train: error: ep_dispatch='node' needs every ep group over several nodes") == 2
    assert "Traceback" not in p.stdout


def test_expert_range_and_validation():
    assert [expert_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="not divisible by ep=3"):
        validate_ep(GPTConfig(n_expert=4), 3)
    validate_ep(GPTConfig(n_expert=4), 4)
    validate_ep(GPTConfig(), 1)
    with pytest.raises(ValueError, match="ep=2 needs a MoE model"):
        validate_ep(GPTConfig(), 2)                  # dense model: nothing to spread


@pytest.mark.mpi
def test_trainer_cli_with_expert_parallelism_matches_ep1(tmp_path):
    """`mpirun -n 4 python -m pympar.train --preset moe-tiny --dp 4 --ep 2`: the same losses as ep=1."""
    import json

    from mpirun import run_mpi

    losses = {}
    for ep in (1, 2):
        out = tmp_path / f"ep{ep}"
        run_mpi(4, ["-m", "pympar.train", "--preset", "moe-tiny", "--dp", "4", "--ep", str(ep), "--steps", "3",
                    "--out", out], timeout=90)
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        losses[ep] = [r["loss"] for r in rows if "loss" in r]
        assert len(losses[ep]) == 3, rows
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-5)
