"""The engine on CuPy against the engine on NumPy (marked `gpu`: skipped without CuPy and a GPU).

Kernels one by one are in test_kernels_gpu.py and NCCLComm's verbs in test_comm_nccl.py; here:
dense and MoE losses and every gradient of a model moved to the GPU against the same model on
the host (float32, and bfloat16/float16 compute within their tolerance), a few AdamW steps
(float32; float16 with the loss scaler), DeviceComm's routing, and the trainer's
``--device cuda`` against ``--device cpu`` end to end.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pympar import backend
from pympar.nn import GPT, GPTConfig
from pympar.optim import AdamW, DynamicLossScaler, clip_grad_norm

cp = backend.cupy_or_none()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs CuPy and a visible GPU")]

DENSE = dict(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
MOE = dict(DENSE, n_expert=4, top_k=2, capacity_factor=1.25, shared_expert=True, bias_update_rate=0.01)


def batch(cfg, seed=0, B=3):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg.vocab_size, (B, cfg.block_size))
    tgt = rng.integers(0, cfg.vocab_size, (B, cfg.block_size))
    tgt[0, :3] = -1                                   # ignored targets take the same path on both
    return idx, tgt


def pair(kw, compute_dtype=None):
    cfg = GPTConfig(**kw)
    host = GPT(cfg, seed=3, compute_dtype=None)
    dev = GPT(cfg, seed=3, compute_dtype=compute_dtype).to("cuda")
    return cfg, host, dev


def grads(model):
    return {n: backend.to_numpy(p.grad).astype(np.float64) for n, p in model.named_parameters()}


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def test_to_cuda_moves_everything_and_keeps_the_tie():
    _, host, dev = pair(MOE)
    for n, p in dev.named_parameters():
        assert backend.is_cupy(p.data) and backend.is_cupy(p.grad), n
    assert dev.head.wte is dev.embedding.wte and backend.is_cupy(dev.head.wte.data)
    for _, m in dev.moe_layers():
        assert backend.is_cupy(m.expert_bias)
    sd_h, sd_d = host.state_dict(), dev.state_dict()        # state dicts are host arrays either way
    assert sd_h.keys() == sd_d.keys()
    for k in sd_h:
        assert isinstance(sd_d[k], np.ndarray)
        np.testing.assert_array_equal(sd_d[k], sd_h[k])


@pytest.mark.parametrize("kw", [DENSE, MOE], ids=["dense", "moe"])
def test_float32_loss_and_every_gradient_match_numpy(kw):
    cfg, host, dev = pair(kw)
    idx, tgt = batch(cfg)
    lh = host.loss_and_grad(idx, tgt, grad_scale=0.5)
    ld = dev.loss_and_grad(idx, tgt, grad_scale=0.5)    # host batches are moved by the model
    assert abs(ld - lh) < 1e-5 * max(1.0, abs(lh))
    gh, gd = grads(host), grads(dev)
    for n in gh:
        np.testing.assert_allclose(gd[n], gh[n], rtol=2e-3, atol=2e-6, err_msg=n)
    assert host.moe_stats() == dev.moe_stats()          # identical routing and drops


@pytest.mark.parametrize("cdt", ["bfloat16", "float16"])
@pytest.mark.parametrize("kw", [DENSE, MOE], ids=["dense", "moe"])
def test_low_precision_gradients_within_tolerance(kw, cdt):
    if cdt == "bfloat16":
        from pympar import gpu
        if not gpu.bfloat16_supported():
            pytest.skip("this CuPy has no bfloat16 arrays")
    cfg, host, dev = pair(kw, compute_dtype=cdt)
    idx, tgt = batch(cfg, 1)
    lh = host.loss_and_grad(idx, tgt)
    ld = dev.loss_and_grad(idx, tgt)
    assert abs(ld - lh) < 3e-2 * max(1.0, abs(lh))
    for n, p in dev.named_parameters():
        assert p.grad.dtype == np.float32, n          # master grads stay float32
    gh, gd = grads(host), grads(dev)
    total = rel_err(np.concatenate([g.ravel() for g in gd.values()]), np.concatenate([g.ravel() for g in gh.values()]))
    assert total < 5e-2, f"{cdt}: relative gradient error {total:.3g}"


def _train(model, cfg, steps, scaler=None):
    opt = AdamW(list(model.named_parameters()), lr=3e-3)
    losses, skipped = [], 0
    for s in range(steps):
        model.zero_grad()
        idx, tgt = batch(cfg, 10 + s)
        scale = scaler.scale if scaler else 1.0
        losses.append(model.loss_and_grad(idx, tgt, grad_scale=scale))
        params = model.parameters()
        if scaler:
            if scaler.update(DynamicLossScaler.found_inf(params)):
                skipped += 1
                continue
            for p in params:
                p.grad *= p.grad.dtype.type(1.0 / scale)
        clip_grad_norm(params, 1.0)
        opt.step()
        model.update_expert_bias()
    return losses, skipped


@pytest.mark.parametrize("kw", [DENSE, MOE], ids=["dense", "moe"])
def test_a_few_adamw_steps_match_the_cpu_run(kw):
    cfg, host, dev = pair(kw)
    lh, _ = _train(host, cfg, 4)
    ld, _ = _train(dev, cfg, 4)
    np.testing.assert_allclose(ld, lh, rtol=2e-4)
    assert ld[-1] < ld[0]
    for (n, ph), (_, pd) in zip(host.named_parameters(), dev.named_parameters()):
        np.testing.assert_allclose(backend.to_numpy(pd.data), ph.data, rtol=1e-3, atol=1e-4, err_msg=n)


def test_float16_with_loss_scaling_tracks_float32():
    cfg, host, dev = pair(DENSE, compute_dtype="float16")
    lh, _ = _train(host, cfg, 5)
    ld, skipped = _train(dev, cfg, 5, DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=2))
    assert skipped < 5
    np.testing.assert_allclose(ld[0], lh[0], rtol=3e-2)
    assert ld[-1] < ld[0]


def test_device_comm_routes_device_and_host_operands():
    from mpi4py import MPI

    from pympar.comm.hybrid import DeviceComm
    from pympar.comm.mpi import MPIComm
    from pympar.comm.nccl import NCCLComm

    c = DeviceComm(NCCLComm(MPIComm(MPI.COMM_WORLD.Dup())))
    x = cp.arange(6, dtype=cp.float32)
    y = c.allreduce(x.copy())
    assert backend.is_cupy(y if y is not None else x)
    h = c.allreduce(np.arange(3.0))
    assert not backend.is_cupy(h if h is not None else np.zeros(1))
    sub = c.split(0, key=c.rank)
    assert isinstance(sub, DeviceComm) and sub.uses_nccl and sub.size == c.size
    c.barrier()


def test_host_staging_lands_results_on_the_device_and_mpicomm_refuses_them(monkeypatch):
    """Without a CUDA-aware MPI (forced), MPIComm refuses CuPy operands naming HostStaging; the
    wrapper runs every verb on host copies and lands the result on the device: in out, in the
    operand (in-place allreduce, broadcast) or in a new device array; the nonblocking verbs on wait()."""
    from mpi4py import MPI

    from pympar.comm import HostStaging
    from pympar.comm.mpi import MPIComm
    from pympar.comm.settings import SETTINGS

    monkeypatch.setattr(SETTINGS, "cuda_aware_mpi", False)
    m = MPIComm(MPI.COMM_WORLD.Dup(), name="stage")
    c = HostStaging(m)
    n, r = c.size, c.rank
    x = cp.full(6, float(r + 1), dtype=cp.float32)
    with pytest.raises(TypeError, match="stage: allreduce got a device .CuPy. operand .*HostStaging"):
        m.allreduce(x)
    want = float(sum(range(1, n + 1)))
    assert c.allreduce(x) is x and cp.asnumpy(x).tolist() == [want] * 6                # in place
    y = c.allreduce(cp.ones(3, cp.float32), inplace=False)
    assert backend.is_cupy(y) and cp.asnumpy(y).tolist() == [float(n)] * 3
    out = cp.zeros(4, cp.float64)
    assert c.iallreduce(cp.ones(4), out=out).wait() is out and cp.asnumpy(out).tolist() == [float(n)] * 4
    g = c.allgather(cp.full((1, 2), float(r)))
    assert backend.is_cupy(g) and cp.asnumpy(g)[:, 0].tolist() == [float(k) for k in range(n)]
    b = cp.full(3, float(r))
    assert c.ibroadcast(b, root=0).wait() is b and cp.asnumpy(b).tolist() == [0.0] * 3
    rs = c.reduce_scatter(cp.ones((n, 2)))
    assert backend.is_cupy(rs) and cp.asnumpy(rs).tolist() == [[float(n)] * 2]
    a = c.alltoall(cp.arange(n, dtype=cp.float32) + 10 * r)
    assert cp.asnumpy(a).tolist() == [float(10 * k + r) for k in range(n)]
    buf = cp.zeros(2)
    got = c.sendrecv(cp.full(2, float(r)), (r + 1) % n, buf, (r - 1) % n)
    assert got is buf and cp.asnumpy(buf).tolist() == [float((r - 1) % n)] * 2
    z = cp.ones(3)
    y = c.iallreduce(z, inplace=False).wait()
    assert y is not z and backend.is_cupy(y) and cp.asnumpy(z).tolist() == [1.0] * 3
    rs = c.ireduce_scatter(cp.ones((n, 2))).wait()
    assert backend.is_cupy(rs) and cp.asnumpy(rs).tolist() == [[float(n)] * 2]
    g = c.iallgather(cp.full((1, 2), float(r))).wait()
    assert backend.is_cupy(g) and cp.asnumpy(g)[:, 0].tolist() == [float(k) for k in range(n)]
    rows, rc = c.alltoallv(cp.full((n, 1), float(r)), np.ones(n, np.int64))
    assert backend.is_cupy(rows) and rc.tolist() == [1] * n and cp.asnumpy(rows)[:, 0].tolist() == [float(k) for k in range(n)]
    out = cp.zeros((n, 1))
    rows, rc = c.ialltoallv(cp.full((n, 1), float(r)), np.ones(n, np.int64), out=out).wait()
    assert rows is out and cp.asnumpy(out)[:, 0].tolist() == [float(k) for k in range(n)]
    land = cp.zeros(2)
    send = c.isend(cp.full(2, 7.0), r, tag=3)
    assert c.irecv(land, r, tag=3).wait() is land and cp.asnumpy(land).tolist() == [7.0, 7.0]
    send.wait()
    sub = c.split(0, key=r)
    assert isinstance(sub, HostStaging)
    sub.free()
    m.free()


def test_trainer_device_cuda_matches_device_cpu(tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    common = [sys.executable, "-m", "pympar.train", "--preset", "tiny", "--block-size", "16", "--micro-batch-size", "2",
              "--n-micro", "2", "--steps", "3", "--eval-iters", "1", "--sample-tokens", "4", "--lr", "1e-3"]
    out = {}
    for dev in ("cpu", "cuda"):
        res = subprocess.run(common + ["--device", dev, "--out", str(tmp_path / dev)], cwd=root, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
        assert res.returncode == 0, res.stdout[-3000:]        # one rank: MPI singleton, no mpiexec
        out[dev] = [json.loads(line) for line in (tmp_path / dev / "metrics.jsonl").read_text().splitlines()]
    lc = [r["loss"] for r in out["cpu"] if "loss" in r]
    lg = [r["loss"] for r in out["cuda"] if "loss" in r]
    assert len(lc) == len(lg) == 3
    np.testing.assert_allclose(lg, lc, rtol=1e-3)
    assert all(0 < r["mfu"] < 1 for r in out["cuda"] if "mfu" in r)


def test_checkpoint_from_the_gpu_resumes_on_either_device(tmp_path):
    """--device cuda saves a checkpoint after 2 of 4 steps; resuming it on the GPU continues the
    uninterrupted GPU run, and resuming it on the host continues it within float32 tolerance."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    common = [sys.executable, "-m", "pympar.train", "--preset", "tiny", "--block-size", "16", "--micro-batch-size", "2",
              "--n-micro", "2", "--steps", "4", "--eval-iters", "1", "--sample-tokens", "0", "--save-every", "2"]

    def losses(out, *extra):
        res = subprocess.run(common + ["--out", str(out), *extra], cwd=root, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=240)
        assert res.returncode == 0, res.stdout[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    ref = losses(tmp_path / "ref", "--device", "cuda")
    ckpt = tmp_path / "ref" / "checkpoints" / "step_00000002"
    assert ckpt.is_dir() and len(ref) == 4
    gpu = losses(tmp_path / "gpu", "--device", "cuda", "--resume", str(ckpt))
    cpu = losses(tmp_path / "cpu", "--device", "cpu", "--resume", str(ckpt))
    later = [2, 3]                                    # steps 0, 1 are in the checkpoint
    assert sorted(gpu) == sorted(cpu) == later and sorted(ref) == [0, 1, 2, 3]
    np.testing.assert_allclose([gpu[s] for s in later], [ref[s] for s in later], rtol=1e-6)
    np.testing.assert_allclose([cpu[s] for s in later], [ref[s] for s in later], rtol=1e-3)
