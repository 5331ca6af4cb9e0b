"""Tokens/s of one training step (forward, backward, AdamW): pympar vs PyTorch eager, same model,
same weights, same threads, side by side in one run; then a cProfile of pympar's step.

    python bench/train_step.py --preset small --batch 8 --threads 1
    python bench/train_step.py --preset moe-small --batch 8 --threads 2 --repeat 3 --json out.json

--repeat R measures the pair R times (each: pympar, PyTorch, pympar again) and reports the
medians; --json merges this run into the file's "table" (one row per preset and thread count)
and puts this run's figures at the top level.
"""
from __future__ import annotations

import argparse
import os
import sys


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: block_size)")
    ap.add_argument("--threads", type=int, default=1)
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

import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pympar import kernels  # noqa: E402
from pympar.kernels import alloc, blas  # noqa: E402
from pympar.nn import GPT, GPTConfig  # noqa: E402
from pympar.optim import AdamW, decays  # noqa: E402


def timed(step, steps, warmup):
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
        if (old.get("batch"), old.get("seq")) == (res["batch"], res["seq"]):
            table = old.get("table", {})
    except (OSError, ValueError):
        pass
    keep = ("params", "blas_threads", "kernel_threads", "pympar_step_s", "pympar_tokens_per_s",
            "torch_step_s", "torch_tokens_per_s", "speed_ratio_pympar_over_torch", "repeats")
    table[f"{res['preset']}/{res['threads']}"] = {k: res[k] for k in keep if k in res}
    with open(path, "w") as f:
        json.dump(dict(res, table=dict(sorted(table.items()))), f, indent=1)


def main(a):
    kernels.set_num_threads(a.threads)
    cfg = GPTConfig.from_preset(a.preset)
    T = a.seq or cfg.block_size
    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (a.batch, T))
    tg = rng.integers(0, cfg.vocab_size, (a.batch, T))
    model = GPT(cfg, seed=0)
    opt = AdamW(model.named_parameters(), lr=1e-4)

    def pympar_step():
        model.zero_grad()
        model.loss_and_grad(idx, tg)
        opt.step()

    res = dict(preset=a.preset, config=vars(cfg), batch=a.batch, seq=T, threads=a.threads,
               native_kernels=kernels.native_available(), blas_threads=blas.blas_threads(),
               kernel_threads=kernels.get_num_threads(), malloc_retained=alloc.retained(),
               params=int(sum(p.data.size for p in model.parameters())))
    torch_step = None
    if not a.no_torch:
        try:
            import torch

            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
            from torch_ref import TorchGPT, load_numpy_state

            torch.set_num_threads(a.threads)
            tm = TorchGPT(cfg).float()
            load_numpy_state(tm, model.state_dict())
            named = list(tm.named_parameters())
            topt = torch.optim.AdamW(
                [dict(params=[p for n, p in named if decays(n, p.detach().numpy())], weight_decay=0.1),
                 dict(params=[p for n, p in named if not decays(n, p.detach().numpy())], weight_decay=0.0)],
                lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
            ti, tt = torch.tensor(idx), torch.tensor(tg)

            def torch_step():
                topt.zero_grad(set_to_none=False)
                _, loss = tm(ti, tt)
                loss.backward()
                topt.step()
            res["torch_version"] = torch.__version__
        except ImportError:
            print("torch not installed: pympar only")
    # interleave the two so machine noise hits both alike: pympar, torch, pympar (best of the two)
    tokens = a.batch * T
    reps = []
    for r in range(max(1, a.repeat)):
        t_p = timed(pympar_step, a.steps, a.warmup if r == 0 else 0)
        rep = dict(pympar_step_s=t_p)
        if torch_step is not None:
            rep["torch_step_s"] = timed(torch_step, a.steps, a.warmup if r == 0 else 0)
            rep["pympar_step_s"] = t_p = min(t_p, timed(pympar_step, a.steps, 0))
            rep["ratio"] = rep["torch_step_s"] / t_p
        reps.append(rep)
    res["repeats"] = reps
    t_p = float(np.median([r["pympar_step_s"] for r in reps]))
    res["pympar_step_s"], res["pympar_tokens_per_s"] = t_p, tokens / t_p
    if torch_step is not None:
        t_t = float(np.median([r["torch_step_s"] for r in reps]))
        res["torch_step_s"], res["torch_tokens_per_s"] = t_t, tokens / t_t
        res["speed_ratio_pympar_over_torch"] = float(np.median([r["ratio"] for r in reps]))

    print(f"\n{a.preset}: {res['params']:,} params, batch {a.batch} x seq {T}, {a.threads} thread(s), "
          f"native kernels: {res['native_kernels']}")
    print(f"{'engine':<10}{'step ms':>10}{'tokens/s':>12}")
    print(f"{'pympar':<10}{1e3 * t_p:>10.1f}{tokens / t_p:>12.0f}"
          + (f"   (medians of {len(reps)} paired repeats)" if len(reps) > 1 else ""))
    if "torch_step_s" in res:
        print(f"{'pytorch':<10}{1e3 * res['torch_step_s']:>10.1f}{res['torch_tokens_per_s']:>12.0f}")
        each = ", ".join(f"{r['ratio']:.2f}" for r in reps)
        print(f"ratio pympar/pytorch tokens/s: {res['speed_ratio_pympar_over_torch']:.2f}x"
              + (f"  (each repeat: {each})" if len(reps) > 1 else ""))
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
