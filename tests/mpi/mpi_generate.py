"""Runs inside every rank: generation on a parallel layout (pympar.parallel.generate) gives the
tokens of one process, greedy and sampled, past the window (the sliding case), for dense and MoE
models on tp, pp (plain, interleaved, ZB-V's V placement), ep and dp layouts of the world size.

The single-process model is saved by rank 0 (GEN_DIR) and restored into each layout's model."""
import os

import numpy as np
import pytest

from pympar.checkpoint import restore_into, save_training
from pympar.layout import Layout
from pympar.nn.config import GPTConfig
from pympar.nn.generate import generate
from pympar.nn.gpt import GPT
from pympar.parallel.generate import build_for_generation, generate_parallel


def _cfg(model):
    return GPTConfig.from_preset("moe-tiny" if model == "moe" else "tiny", n_layer=4, n_head=4, n_embd=32,
                                 block_size=24).validate()


def _layouts(world):
    """(model, tp, pp, ep, virtual stages, schedule) of this world size."""
    out = [("dense", world, 1, 1, 1, "1f1b"), ("dense", 1, world, 1, 1, "1f1b"), ("dense", 1, 1, 1, 1, "1f1b"),
           ("dense", 1, 2, 1, 2, "interleaved"), ("dense", 1, 2, 1, 2, "zb-v"),
           ("moe", 1, 1, 2, 1, "1f1b"), ("moe", 1, 2, 1, 1, "1f1b")]
    if world == 4:
        out += [("dense", 2, 2, 1, 1, "1f1b"), ("moe", 2, 1, 2, 1, "1f1b"), ("moe", 1, 2, 2, 1, "1f1b"),
                ("moe", 1, 1, 4, 1, "1f1b"), ("moe", 2, 2, 1, 2, "interleaved")]
    return [c for c in out if world % (c[1] * c[2]) == 0 and (world // (c[1] * c[2])) % c[3] == 0]


@pytest.fixture(scope="module")
def saved(mpi_world):
    """{model: (single-process GPT, checkpoint directory)}, the same on every rank."""
    out = {}
    for model in ("dense", "moe"):
        m = GPT(_cfg(model), seed=5)
        d = os.path.join(os.environ["GEN_DIR"], model)
        if mpi_world.Get_rank() == 0:
            save_training(d, 1, m)
        mpi_world.Barrier()
        out[model] = (m, d)
    return out


def _fits(case, world):
    _, tp, pp, ep, _, _ = case
    return world % (tp * pp) == 0 and (world // (tp * pp)) % ep == 0


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


CASES = [c for c in sorted(set(_layouts(2)) | set(_layouts(4))) if _fits(c, _world())]   # those this job can run


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_layout_generates_the_tokens_of_one_process(case, saved, mpi_world):
    from pympar.comm import MPIComm

    model, tp, pp, ep, v, schedule = case
    world = mpi_world.Get_size()
    comm = MPIComm(mpi_world, timeout=60)
    single, d = saved[model]
    lay = Layout(dp=world // (tp * pp), tp=tp, pp=pp, ep=ep, n_micro=pp, virtual_stages=v, schedule=schedule)
    par, mesh = build_for_generation(single.config, comm, lay)
    restore_into(par, None, d, comm)
    prompt = np.array([[10, 20, 30, 40, 50], [1, 2, 3, 4, 5]])
    for top_k, seed in ((1, 0), (None, 7)):
        want = generate(single, prompt, 30, top_k=top_k, rng=np.random.default_rng(seed))   # past block_size 24
        got = generate_parallel(par, mesh, prompt, 30, top_k=top_k, rng=np.random.default_rng(seed))
        assert got.shape == (2, 35)
        np.testing.assert_array_equal(got, want, err_msg=f"{case} top_k={top_k}")
    comm.free()
