"""Sharded checkpoints under real mpiexec jobs: resharding between layouts and rank counts."""
import pytest

from mpirun import run_pytest_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [4])
def test_reshard_pairs_in_one_job(n, tmp_path):
    # pairs of (save ranks, layout) -> (load ranks, layout) on sub-communicators of one job
    run_pytest_mpi(n, "mpi_checkpoint.py", timeout=60, env={"CKPT_DIR": tmp_path}, extra_args=["-k", "not test_phase"])


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3])
def test_mpi_checkpoint_other_sizes(n, tmp_path):
    run_pytest_mpi(n, "mpi_checkpoint.py", timeout=90, env={"CKPT_DIR": tmp_path}, extra_args=["-k", "not test_phase"])


@pytest.mark.parametrize("n_save,lay_save,n_load,lay_load", [(2, "rows", 4, "qkv"), (4, "cols", 1, "replicated")])
def test_reshard_across_jobs(tmp_path, n_save, lay_save, n_load, lay_load):
    """The saving job ends before the loading job (of another size) starts."""
    env = {"CKPT_DIR": tmp_path, "CKPT_PHASE": "save", "CKPT_LAYOUT": lay_save}
    run_pytest_mpi(n_save, "mpi_checkpoint.py", timeout=60, env=env, extra_args=["-k", "test_phase"])
    env.update(CKPT_PHASE="load", CKPT_LAYOUT=lay_load, CKPT_SAVED_BY=n_save)
    run_pytest_mpi(n_load, "mpi_checkpoint.py", timeout=60, env=env, extra_args=["-k", "test_phase"])


@pytest.mark.parametrize("n", [2])
def test_tensor_parallel_model_checkpoint(n, tmp_path):
    """TPGPT on n ranks -> checkpoint -> single-process GPT and a fresh TPGPT continue the run."""
    run_pytest_mpi(n, "mpi_checkpoint_model.py", timeout=90, env={"CKPT_DIR": tmp_path})
