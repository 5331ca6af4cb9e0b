"""Short GPU benchmark for bench/gpu_check.sh: kernels vs CuPy expressions, a training step vs
PyTorch on the same GPU, MFU. Every section is guarded: a failure is recorded, not fatal.

    python bench/gpu_bench.py --json gpu_bench.json [--budget 60]

Times are CUDA-event times of the mean of `reps` calls after warm-ups. The "CuPy expression"
of a kernel is its pure-xp reference (pympar.kernels.reference) run on CuPy arrays.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402

RESULT = {"sections": {}, "errors": {}}
T_START = time.time()


def section(name):
    def deco(fn):
        def run(*a, **k):
            t0 = time.time()
            try:
                RESULT["sections"][name] = fn(*a, **k)
            except Exception as e:  # record and go on: the script runs once, blind
                RESULT["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            RESULT.setdefault("section_seconds", {})[name] = round(time.time() - t0, 2)
        return run
    return deco


def cuda_time(cp, fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / reps / 1e3   # seconds per call


@section("device")
def device_info(cp):
    from pympar import gpu, kernels

    name = gpu.device_name()
    return dict(name=name, cupy=cp.__version__, cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                table_peak_bf16=gpu.peak_flops(name, "bfloat16"), bf16_arrays=gpu.bfloat16_supported(),
                pympar_cuda_built=kernels.cuda_available(), native_cpu_built=kernels.native_available())


@section("gemm_peak")
def gemm_peak(cp):
    from pympar import backend, gpu

    out = {}
    n = 8192
    for dt in ["float16", "bfloat16", "float32"]:
        if dt == "bfloat16" and not gpu.bfloat16_supported():
            out[dt] = "no bfloat16 in this CuPy"
            continue
        a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(backend.dtype(dt))
        s = cuda_time(cp, lambda: a @ a, reps=5, warmup=2)
        out[dt] = dict(tflops=2 * n ** 3 / s / 1e12, n=n)
        a = None                      # free it before the next dtype's
    return out


@section("kernels")
def kernels_vs_cupy(cp):
    from pympar import backend, kernels
    from pympar.kernels import reference as R

    if not kernels.cuda_available():
        return "pympar._cuda not built: nothing to compare (the reference serves CuPy arrays)"
    from pympar.kernels import cuda as G

    f32 = cp.float32
    cp.random.seed(0)

    def rnd(shape, dt=f32):
        return cp.random.standard_normal(shape, dtype=f32).astype(dt)

    N, C, V, T, H = 8192, 768, 50304 // 4, 512, 12
    dts = [np.dtype(np.float32), np.dtype(np.float16)]
    try:
        cp.zeros(1, dtype=backend.bfloat16)
        dts.append(backend.bfloat16)
    except Exception:
        pass
    rows = []
    for dt in dts:
        x, w, b = rnd((N, C), dt), rnd((C,), dt), rnd((C,), dt)
        att = rnd((4, H, T, T), dt)
        h4 = rnd((N, 4 * C), dt)
        logits = rnd((N // 4, V), dt)
        tgt = cp.asarray(np.random.default_rng(0).integers(0, V, N // 4))
        cases = {
            "layernorm_forward": (lambda: G.layernorm_forward(x, w, b), lambda: R.layernorm_forward(x, w, b)),
            "gelu_forward": (lambda: G.gelu_forward(h4), lambda: R.gelu_forward(h4)),
            "softmax_causal_forward": (lambda: G.softmax_causal_forward(att), lambda: R.softmax_causal_forward(att)),
            "cross_entropy_forward": (lambda: G.cross_entropy_forward(logits, tgt),
                                      lambda: R.cross_entropy_forward(logits, tgt)),
        }
        for name, (kern, expr) in cases.items():
            try:
                tk, te = cuda_time(cp, kern), cuda_time(cp, expr, reps=5, warmup=1)
                rows.append(dict(kernel=name, dtype=backend.dtype_name(dt), pympar_us=tk * 1e6, cupy_expr_us=te * 1e6,
                                 speedup=te / tk))
            except Exception as e:
                rows.append(dict(kernel=name, dtype=backend.dtype_name(dt), error=f"{type(e).__name__}: {e}"))
    n = 124_000_000 // 8
    p, g, m, v = (rnd((n,)) for _ in range(4))
    v = cp.abs(v)
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)
    tk = cuda_time(cp, lambda: G.adamw_step(p, g, m, v, **kw))
    te = cuda_time(cp, lambda: R.adamw_step(p, g, m, v, **kw), reps=5, warmup=1)
    rows.append(dict(kernel="adamw_step", dtype="float32", n=n, pympar_us=tk * 1e6, cupy_expr_us=te * 1e6,
                     speedup=te / tk, pympar_GBps=n * 4 * 7 / tk / 1e9))
    return rows


def _model_cfg(args):
    from pympar.nn import GPTConfig

    return GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=args.layers, n_head=12, n_embd=768)


@section("train_step")
def train_step(cp, args):
    from pympar import backend, gpu, metrics
    from pympar.nn import GPT
    from pympar.optim import AdamW, clip_grad_norm

    cfg = _model_cfg(args)
    cdt = "bfloat16" if gpu.bfloat16_supported() else "float16"
    model = GPT(cfg, seed=0, compute_dtype=cdt).to("cuda")
    opt = AdamW(list(model.named_parameters()), lr=1e-4)
    rng = np.random.default_rng(0)
    idx = cp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size)))
    tgt = cp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size)))
    losses = []

    def step():
        model.zero_grad()
        losses.append(model.loss_and_grad(idx, tgt))
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()

    s = cuda_time(cp, step, reps=args.steps, warmup=2)
    tokens = args.batch * cfg.block_size
    fpt = metrics.flops_per_token(cfg)
    peak = gpu.peak_flops(gpu.device_name(), "bfloat16")
    out = dict(config=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, block_size=cfg.block_size, vocab=cfg.vocab_size,
                           batch=args.batch, compute_dtype=cdt),
               step_ms=s * 1e3, tokens_per_s=tokens / s, model_tflops=fpt * tokens / s / 1e12,
               mfu_vs_table_bf16=(fpt * tokens / s / peak) if peak else None, losses=[float(x) for x in losses],
               mem_used_GiB=cp.get_default_memory_pool().used_bytes() / 2 ** 30)
    RESULT["_state"] = {k: backend.to_numpy(v) for k, v in GPT(cfg, seed=0).state_dict().items()}
    model = opt = None                # free them before the pool is emptied
    cp.get_default_memory_pool().free_all_blocks()
    return out


@section("torch_step")
def torch_step(cp, args):
    import torch

    if not torch.cuda.is_available():
        return "torch without CUDA: no peer"
    from torch_ref import TorchGPT, load_numpy_state

    from pympar import metrics

    cfg = _model_cfg(args)
    torch.set_default_device("cuda")            # torch_ref builds positions with torch.arange(T)
    model = TorchGPT(cfg)
    state = RESULT.pop("_state", None)
    if state is not None:
        load_numpy_state(model, state)
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=g, device="cpu").cuda()
    tgt = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=g, device="cpu").cuda()
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(args.steps):
        step()
    b.record()
    torch.cuda.synchronize()
    s = a.elapsed_time(b) / args.steps / 1e3
    tokens = args.batch * cfg.block_size
    torch.set_default_device("cpu")
    return dict(step_ms=s * 1e3, tokens_per_s=tokens / s, model_tflops=metrics.flops_per_token(cfg) * tokens / s / 1e12,
                torch=torch.__version__, autocast="bfloat16", losses=[float(x) for x in losses])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="gpu_bench.json")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from pympar import backend

    cp = backend.cupy_or_none()
    if cp is None:
        RESULT["errors"]["cupy"] = "CuPy missing or no visible GPU"
    else:
        device_info(cp)
        gemm_peak(cp)
        kernels_vs_cupy(cp)
        train_step(cp, args)
        torch_step(cp, args)
        ps, ts = RESULT["sections"].get("train_step"), RESULT["sections"].get("torch_step")
        if isinstance(ps, dict) and isinstance(ts, dict):
            RESULT["pympar_over_torch_tokens_per_s"] = ps["tokens_per_s"] / ts["tokens_per_s"]
    RESULT.pop("_state", None)
    RESULT["seconds"] = round(time.time() - T_START, 1)
    with open(args.json, "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in RESULT.items() if k != "sections"}, default=str)[:3000])
    for k, v in RESULT["sections"].items():
        print(k, json.dumps(v, default=str)[:1500])


if __name__ == "__main__":
    main()
