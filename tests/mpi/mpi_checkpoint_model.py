"""Runs inside every rank: a tensor-parallel GPT (pympar.parallel.tp.TPGPT over COMM_WORLD) +
AdamW saved with save_training, restored into a single-process GPT and into a fresh TPGPT;
both continue the single-process run's losses (float tolerance: TP sums in another order)."""
import os

import numpy as np
import pytest

from pympar.checkpoint import restore_into, save_training
from pympar.checkpoint.collectives import allgather_json
from pympar.nn.config import GPTConfig
from pympar.nn.gpt import GPT
from pympar.optim.adamw import AdamW


def _steps(model, opt, batches):
    out = []
    for idx in batches:
        model.zero_grad()
        out.append(model.loss_and_grad(idx, np.roll(idx, -1, axis=1)))
        opt.step()
    return out


def test_tp_checkpoint_into_single_and_back(mpi_world):
    from pympar.comm import MPIComm
    from pympar.parallel.tp.gpt import TPGPT
    comm = MPIComm(mpi_world, timeout=60)
    n = comm.size
    if 4 % n:
        pytest.skip("n_head=4 needs tp dividing 4")
    cfg = GPTConfig.from_preset("tiny", n_head=4, block_size=16)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.vocab_size, (2, 16)) for _ in range(4)]
    ref_model = GPT(cfg, seed=3)
    ref = _steps(ref_model, AdamW(ref_model.named_parameters(), lr=1e-2), batches)

    d = os.path.join(os.environ["CKPT_DIR"], "tp")
    tp = TPGPT(cfg, comm, seed=3)
    opt = AdamW(tp.named_parameters(), lr=1e-2)
    _steps(tp, opt, batches[:2])
    save_training(d, 2, tp, opt, comm=comm, meta={"layout": {"tp": n}})

    errors = []
    single = GPT(cfg, seed=99)
    sopt = AdamW(single.named_parameters(), lr=1e-2)
    restore_into(single, sopt, d)                        # every rank alone: tp=n -> 1 process
    got = _steps(single, sopt, batches[2:])
    if not np.allclose(got, ref[2:], rtol=1e-5, atol=1e-6):
        errors.append(f"rank {mpi_world.rank}: single-process resume {got} != {ref[2:]}")

    tp2 = TPGPT(cfg, comm, seed=99)
    opt2 = AdamW(tp2.named_parameters(), lr=1e-2)
    m = restore_into(tp2, opt2, d, comm=comm)
    assert m["meta"]["layout"] == {"tp": n} and opt2.step_count == 2
    got = _steps(tp2, opt2, batches[2:])
    if not np.allclose(got, ref[2:], rtol=1e-5, atol=1e-6):
        errors.append(f"rank {mpi_world.rank}: tp={n} resume {got} != {ref[2:]}")
    errors = [e for per in allgather_json(comm, errors) for e in per]
    assert not errors, "\n".join(errors)
