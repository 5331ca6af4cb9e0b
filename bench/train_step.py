"""Tokens/s of one training step (forward, backward, AdamW): pympar vs the PyTorch a user would
run -- eager with F.scaled_dot_product_attention ("sdpa"), torch.compile of that model
("compile"), and eager with the hand-written attention ("naive") -- same model, same weights,
same threads, side by side in one run; beside them model FLOP/s (PaLM's count: 6 N + 12 L C T
per token, attention included) as a fraction of this process's measured sgemm rate at the same
threads; then a cProfile of pympar's step.

    python bench/train_step.py --preset small --batch 8 --threads 1
    python bench/train_step.py --preset small --set n_embd=256 --batch 8 --threads 2 --repeat 3
    python bench/train_step.py --preset gpt2-124m --batch 1 --threads 2 --peers sdpa
    python bench/train_step.py --preset small --set n_embd=512 --set n_layer=6 --batch 4 --dtype bfloat16

--dtype bfloat16: pympar's mixed precision (bf16 products on the CPU's matrix engines, float32
master weights, gradients and AdamW) against the same PyTorch peers under
torch.autocast("cpu", dtype=torch.bfloat16), plus pympar in float32; MFU then counts against the
bf16 GEMM rate of the same shape (the faster of pympar's, MKL's cblas_gemm_bf16bf16f32, and
PyTorch's).

--repeat R measures the round R times (each: the sgemm rates, pympar, every peer, pympar again;
pympar's best of its two; each round's MFU against that round's sgemm) and reports the medians;
--json merges this run into the file's "table" (one row per shape and thread count) and puts this
run's figures at the top level.
"""
from __future__ import annotations

import argparse
import os
import sys

PEERS = ("sdpa", "compile", "naive")


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=INT",
                    help="override a GPTConfig field of the preset (repeatable), e.g. n_embd=256")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma-separated PyTorch peers among {','.join(PEERS)} (default: all)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: block_size)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="pympar's compute dtype; bfloat16 runs the peers under CPU autocast")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="paired measurements; medians reported")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--profile", type=int, default=15, help="rows of the cProfile summary (0: none)")
    return ap.parse_args()


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None:   # before numpy/torch load their thread pools
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PYMPAR_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import contextlib  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pympar import kernels  # noqa: E402
from pympar.kernels import blas, gemm, malloc_policy  # noqa: E402
from pympar.nn import GPT, GPTConfig  # noqa: E402
from pympar.optim import AdamW, decays  # noqa: E402
from pympar.config import apply_environment  # noqa: E402

apply_environment()          # as the trainer does first: the allocator policy, PYMPAR_* settings


def timed(step, steps, warmup, settle=0.0):
    """The median time of ``steps`` calls of step after ``warmup`` more. ``settle`` seconds idle
    first: the engine before it leaves its BLAS's or OpenMP's worker threads spinning for a while,
    and at 2 threads on 2 cores this engine's first steps would run against them (bench/gemm.py
    timed products call by call, each right after the other library's, 1.65-2.4x slower at 2 threads)."""
    time.sleep(settle)
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def write_json(path, res):
    """This run at the top level; the file's earlier runs kept in "table" (key preset/threads,
    same batch and seq only), this run's row added or replaced."""
    table = {}
    try:
        with open(path) as f:
            old = json.load(f)
        table = old.get("table", {}) if "shape" in old else {}
    except (OSError, ValueError):
        pass
    keep = ("shape", "dtype", "params", "blas_threads", "kernel_threads", "gemm_library", "bf16_engine", "pympar_step_s",
            "pympar_tokens_per_s", "sgemm_gflops", "sgemm_numpy_gflops", "sgemm_pympar_gflops", "bf16_gemm_gflops",
            "bf16_gemm_pympar_gflops", "bf16_gemm_torch_gflops", "pympar_mfu_vs_sgemm", "pympar_mfu_vs_bf16_gemm",
            "repeats") + tuple(f"{p}_{k}" for p in (*PEERS, "pympar_f32")
                               for k in ("step_s", "tokens_per_s", "mfu_vs_sgemm", "mfu_vs_bf16_gemm", "speed_ratio"))
    key = f"{res['shape']}/{res['threads']}" + ("/bf16" if res.get("dtype") == "bfloat16" else "")
    table[key] = {k: res[k] for k in keep if k in res}
    with open(path, "w") as f:
        json.dump(dict(res, table=dict(sorted(table.items()))), f, indent=1)


def shape_name(cfg, B, T):
    return f"L{cfg.n_layer} D{cfg.n_embd} H{cfg.n_head} V{cfg.vocab_size} T{T} B{B}"


def model_flops_per_token(cfg, n_params, T):
    """PaLM's count (appendix B): 6 N + 12 L C T per token, N all parameters (the tied head once)."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * T


def sgemm_gflops(M, K, N, reps=5):
    """This process's float32 GEMM rates on the step's largest GEMM (tokens x C times C x 4C):
    {"numpy": NumPy's BLAS, "pympar": pympar's products (nn.products.matmul: MKL where it runs
    them, kernels/gemm.py)}. MFU is counted against the faster of the two."""
    from common import best                      # bench/common.py: the fastest of reps calls

    from pympar.nn.products import matmul
    rng = np.random.default_rng(1)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    out = np.empty((M, N), np.float32)
    rates = {}
    for name, fn in (("numpy", lambda: np.matmul(x, w, out=out)), ("pympar", lambda: matmul(x, w, out=out))):
        rates[name] = 2 * M * K * N / best(fn, reps) / 1e9
    return rates


def bf16_gemm_gflops(M, K, N, reps=5, with_torch=True):
    """The bf16 GEMM rates (bf16 operands, float32 accumulation, bf16 out) of the step's largest GEMM
    (tokens x C times C x 4C, the weight on the right as Linear reads it): {"pympar": nn.products's
    bf16 product (on the engine kernels/gemm.py chose), "torch": torch.nn.functional.linear}. MFU
    counts against the faster."""
    from common import best

    from pympar.backend import bfloat16
    from pympar.nn.products import compute_copies, linear_bf16
    from pympar.kernels import gemm as g
    rng = np.random.default_rng(1)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    xb, wb = x.astype(bfloat16), w.astype(bfloat16)
    out = np.empty((M, N), bfloat16)
    rates = {}
    with compute_copies():
        g.packable(wb)
        if linear_bf16(xb, wb.T, out) is not None:
            rates["pympar"] = 2 * M * K * N / best(lambda: linear_bf16(xb, wb.T, out), reps) / 1e9
    if with_torch:
        try:
            import torch
            tx, tw = torch.from_numpy(x).bfloat16(), torch.from_numpy(w).bfloat16()
            rates["torch"] = 2 * M * K * N / best(lambda: torch.nn.functional.linear(tx, tw), reps) / 1e9
        except ImportError:
            pass
    return rates


def torch_peers(a, cfg, model, idx, tg, names):
    """name -> step function, one PyTorch model per peer with pympar's weights."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from torch_ref import TorchGPT, load_numpy_state, use_sdpa

    torch.set_num_threads(a.threads)
    ti, tt = torch.tensor(idx), torch.tensor(tg)
    steps = {}
    for name in names:
        tm = TorchGPT(cfg).float()
        load_numpy_state(tm, model.state_dict())
        use_sdpa(tm, name != "naive")
        named = list(tm.named_parameters())
        topt = torch.optim.AdamW(
            [dict(params=[p for n, p in named if decays(n, p.detach().numpy())], weight_decay=0.1),
             dict(params=[p for n, p in named if not decays(n, p.detach().numpy())], weight_decay=0.0)],
            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
        fwd = torch.compile(tm) if name == "compile" else tm
        cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.dtype == "bfloat16" else contextlib.nullcontext

        def step(fwd=fwd, topt=topt, cast=cast):
            topt.zero_grad(set_to_none=False)
            with cast():                         # autocast: the forward only, as PyTorch's recipe has it
                _, loss = fwd(ti, tt)
            loss.backward()
            topt.step()
        steps[name] = step
    return steps, torch.__version__


def main(a):
    if not a.no_torch:
        try:                                     # before pympar's first product loads MKL: a torch
            import torch  # noqa: F401           # loaded after would bind its MKL calls to pympar's
        except ImportError:                      # (kernels/gemm.py, "Other MKLs in the process")
            pass
    kernels.set_num_threads(a.threads)
    over = {}
    for kv in a.set:
        k, _, v = kv.partition("=")
        over[k.strip()] = int(v)
    cfg = GPTConfig.from_preset(a.preset, **over)
    T = a.seq or cfg.block_size
    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (a.batch, T))
    tg = rng.integers(0, cfg.vocab_size, (a.batch, T))
    lowp = a.dtype == "bfloat16"
    model = GPT(cfg, seed=0, compute_dtype=a.dtype if lowp else None)
    opt = AdamW(model.named_parameters(), lr=1e-4)

    def make_step(m, o):
        def step():
            m.zero_grad()
            m.loss_and_grad(idx, tg)
            o.step()
        return step

    pympar_step = make_step(model, opt)
    engines = {}                                 # pympar's other runs beside the peers
    if lowp:                                     # pympar in float32, the same weights
        m32 = GPT(cfg, seed=0)
        engines["pympar_f32"] = make_step(m32, AdamW(m32.named_parameters(), lr=1e-4))

    n_params = int(sum(p.data.size for p in model.parameters()))
    tokens = a.batch * T
    res = dict(preset=a.preset, shape=shape_name(cfg, a.batch, T), dtype=a.dtype, config=vars(cfg), batch=a.batch,
               seq=T,
               threads=a.threads, native_kernels=kernels.native_available(), blas_threads=blas.blas_threads(),
               kernel_threads=kernels.get_num_threads(), malloc_retained=malloc_policy.retained(), params=n_params,
               model_flops_per_step=model_flops_per_token(cfg, n_params, T) * tokens)
    res["gemm_library"] = gemm.describe()
    if lowp:
        res["bf16_engine"] = gemm.describe_bf16()
    names = [] if a.no_torch else [p for p in a.peers.split(",") if p]
    bad = [p for p in names if p not in PEERS]
    if bad:
        raise SystemExit(f"--peers: unknown {bad}: expected some of {PEERS}")
    peers = {}
    if names:
        try:
            peers, res["torch_version"] = torch_peers(a, cfg, model, idx, tg, names)
        except ImportError:
            print("torch not installed: pympar only")
    # one round: pympar, each peer, pympar again (its best of two), so machine noise hits all alike
    reps = []
    settle = 0.3 if a.threads > 1 else 0.0
    flops = res["model_flops_per_step"]
    for r in range(max(1, a.repeat)):
        warm = a.warmup if r == 0 else 0
        # MFU's denominator, the process's faster sgemm, measured in every round beside its steps:
        # this VM's speed drifts by 10-20% over minutes, and one rate from the start of the run
        # moved every engine's MFU with it (the speed ratios, paired within a round, do not)
        rates = sgemm_gflops(tokens, cfg.n_embd, 4 * cfg.n_embd)
        rep = {"sgemm_numpy_gflops": rates["numpy"], "sgemm_pympar_gflops": rates["pympar"],
               "sgemm_gflops": max(rates.values())}
        if lowp:
            b16 = bf16_gemm_gflops(tokens, cfg.n_embd, 4 * cfg.n_embd, with_torch=not a.no_torch)
            rep.update({f"bf16_gemm_{k}_gflops": v for k, v in b16.items()})
            rep["bf16_gemm_gflops"] = max(b16.values())
        peak = rep["bf16_gemm_gflops" if lowp else "sgemm_gflops"]
        t_p = timed(pympar_step, a.steps, warm, settle)
        for name, step in engines.items():
            rep[f"{name}_step_s"] = timed(step, a.steps, warm, settle)
        for name, step in peers.items():
            rep[f"{name}_step_s"] = timed(step, a.steps, warm + (2 if name == "compile" and r == 0 else 0), settle)
        if peers:
            t_p = min(t_p, timed(pympar_step, a.steps, 0, settle))
        rep["pympar_step_s"] = t_p
        for name in ("pympar", *engines, *peers):
            rep[f"{name}_mfu"] = flops / rep[f"{name}_step_s"] / 1e9 / peak
        for name in (*engines, *peers):
            rep[f"{name}_ratio"] = rep[f"{name}_step_s"] / t_p
        reps.append(rep)
    res["repeats"] = reps
    med = lambda k: float(np.median([r[k] for r in reps]))  # noqa: E731
    for k in ("sgemm_numpy_gflops", "sgemm_pympar_gflops", "sgemm_gflops", "bf16_gemm_pympar_gflops",
              "bf16_gemm_torch_gflops", "bf16_gemm_gflops"):
        if k in reps[0]:
            res[k] = med(k)
    t_p = med("pympar_step_s")
    res["pympar_step_s"], res["pympar_tokens_per_s"] = t_p, tokens / t_p
    mfu_key = "mfu_vs_bf16_gemm" if lowp else "mfu_vs_sgemm"
    res[f"pympar_{mfu_key}"] = med("pympar_mfu")                    # each round's MFU, the median
    for name in (*engines, *peers):
        t = med(f"{name}_step_s")
        res[f"{name}_step_s"], res[f"{name}_tokens_per_s"] = t, tokens / t
        res[f"{name}_{mfu_key}"] = med(f"{name}_mfu")
        res[f"{name}_speed_ratio"] = med(f"{name}_ratio")          # pympar's speed / the peer's

    print(f"\n{res['shape']} ({a.preset}): {n_params:,} params, {a.threads} thread(s), "
          f"native kernels: {res['native_kernels']}; GEMM {res['gemm_library']}; "
          f"sgemm {res['sgemm_gflops']:.0f} GFLOP/s (NumPy's {res['sgemm_numpy_gflops']:.0f}, "
          f"pympar's {res['sgemm_pympar_gflops']:.0f})")
    if lowp:
        print(f"bf16 GEMM {res['bf16_gemm_gflops']:.0f} GFLOP/s (pympar's {res.get('bf16_gemm_pympar_gflops', 0):.0f}, "
              f"PyTorch's {res.get('bf16_gemm_torch_gflops', 0):.0f}); pympar in bfloat16, the peers under autocast")
    mfu_head = "MFU/bf16" if lowp else "MFU/sgemm"
    print(f"{'engine':<24}{'step ms':>10}{'tokens/s':>12}{mfu_head:>11}{'pympar x':>10}")
    print(f"{'pympar ' + a.dtype:<24}{1e3 * t_p:>10.1f}{tokens / t_p:>12.0f}{res['pympar_' + mfu_key]:>11.2f}")
    label = dict(sdpa="torch eager + SDPA", compile="torch.compile + SDPA", naive="torch eager, naive attn",
                 pympar_f32="pympar float32")
    for name in (*engines, *peers):
        print(f"{label[name]:<24}{1e3 * res[name + '_step_s']:>10.1f}{res[name + '_tokens_per_s']:>12.0f}"
              f"{res[name + '_' + mfu_key]:>11.2f}{res[name + '_speed_ratio']:>10.2f}")
    if len(reps) > 1:
        print(f"(medians of {len(reps)} rounds)")
    print(f"threads: BLAS {res['blas_threads']}, C++ kernels {res['kernel_threads']}; "
          f"freed memory retained: {res['malloc_retained']}")

    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(max(1, a.steps)):
            pympar_step()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.profile)
        text = s.getvalue()
        print("\npympar step profile (by own time):")
        print(text[text.find("ncalls"):] if "ncalls" in text else text)
        res["profile_top"] = [
            dict(func=f"{k[0].split('/')[-1]}:{k[1]}({k[2]})", calls=v[1], tottime_s=v[2])
            for k, v in sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:a.profile]]
    if a.json:
        write_json(a.json, res)
    return res


if __name__ == "__main__":
    main(ARGS)
