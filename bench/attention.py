"""Causal attention: pympar's tiled kernel vs its materialized path vs PyTorch SDPA, and the peak
memory of a small model as the sequence grows.

    python bench/attention.py                # T 1024 and 4096, 1 and 2 threads, memory at T 1024-4096
    python bench/attention.py --quick        # T 256, 1 thread (the smoke test)

Speed: forward + backward of the attention core alone (qkv -> output -> dqkv) for a 128-wide
layer with 4 heads (and gpt2-124m's 12 heads of 64 at T 1024), batch 1, float32: pympar's tiled
kernel (the default), pympar's materialized path (the (T, T) probabilities, the reference) and
F.scaled_dot_product_attention(is_causal=True) forward + backward, interleaved in one process,
each the best of --reps calls, at the same thread count (kernels.set_num_threads /
torch.set_num_threads). FLOP/s count 7 T^2 D per head (2 GEMMs forward, 5 backward, causal half).

Memory: peak resident memory (VmHWM, read by /usr/bin/time after the process exits) of one
process training the 2-layer, 128-wide model (4 heads, vocabulary 256) for 2 steps at micro-batch
1, with the tiled and with the materialized attention, and with the tiled attention and
selective and full activation recomputation, at each T; the model's block_size is T in these
columns, so its position table (and that table's gradient and Adam moments) grows with T too.
One more column trains one model, block_size the longest T, at every T: what a user with a
4096-token model sees between short and long sequences. The target (issue 14): tiled peak at T
4096 at most 1.5x its peak at T 1024. ``--memory-only`` measures only the memory and keeps the
speed rows of an earlier run's JSON.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, best, env, machine, pyplot, run_and_write, save  # noqa: E402


TRAIN = """
import sys, numpy as np
from pympar import kernels
from pympar.nn import GPT, GPTConfig
from pympar.nn.gpt import set_recompute
from pympar.nn.attention_core import CausalAttentionCore
from pympar.optim import AdamW
from pympar.config import apply_environment

apply_environment()          # as the trainer does first: the allocator policy, PYMPAR_* settings
T, impl, recompute = int(sys.argv[1]), sys.argv[2], sys.argv[3]
block_size = int(sys.argv[4]) if len(sys.argv) > 4 else T     # the model's context (default: T itself)
CausalAttentionCore.impl = impl
cfg = GPTConfig(vocab_size=256, block_size=block_size, n_layer=2, n_head=4, n_embd=128)
model = GPT(cfg, seed=0)
set_recompute(model, recompute)
opt = AdamW(model.named_parameters(), lr=1e-4)
x = np.random.default_rng(0).integers(0, 256, size=(1, T + 1))
for _ in range(2):
    model.zero_grad()
    model.loss_and_grad(x[:, :-1], x[:, 1:])
    opt.step()
"""


def speed(shapes, threads, reps):
    import torch
    import torch.nn.functional as F

    from pympar import kernels
    from pympar.nn.attention_core import CausalAttentionCore

    rows = []
    for th in threads:
        kernels.set_num_threads(th)
        torch.set_num_threads(th)
        for (T, H, D) in shapes:
            rng = np.random.default_rng(0)
            qkv = rng.standard_normal((1, T, 3, H, D)).astype(np.float32)
            dya = rng.standard_normal((1, T, H * D)).astype(np.float32)
            fns = {}
            for impl in ("tiled", "materialized"):
                core = CausalAttentionCore()
                core.impl = impl

                def run(core=core):
                    ya, ctx = core.forward(qkv)
                    core.backward(dya, ctx)
                fns[impl] = run
            q, k, v = (t.clone().requires_grad_() for t in torch.from_numpy(qkv).permute(2, 0, 3, 1, 4).contiguous())
            do = torch.from_numpy(dya).reshape(1, T, H, D).permute(0, 2, 1, 3).contiguous()

            def sdpa():
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                y.backward(do)
                q.grad = k.grad = v.grad = None
            fns["sdpa"] = sdpa
            ts = {name: best(fn, reps, warm_s=0.3) for name, fn in fns.items()}
            flops = 7 * H * T * T * D
            row = dict(T=T, heads=H, head_size=D, threads=th, **{f"{n}_s": t for n, t in ts.items()},
                       **{f"{n}_gflops": flops / t / 1e9 for n, t in ts.items()},
                       tiled_over_sdpa=ts["sdpa"] / ts["tiled"], tiled_over_materialized=ts["materialized"] / ts["tiled"])
            rows.append(row)
            print(f"T {T:5d} {H:2d}x{D:<3d} {th} thr: tiled {1e3 * ts['tiled']:7.1f} ms  materialized "
                  f"{1e3 * ts['materialized']:7.1f}  sdpa {1e3 * ts['sdpa']:7.1f}  -> tiled is "
                  f"{row['tiled_over_sdpa']:.2f}x SDPA's speed, {row['tiled_over_materialized']:.2f}x the materialized",
                  flush=True)
    kernels.set_num_threads(1)
    return rows


def peak_rss(T, impl, recompute="none", block_size=None):
    with tempfile.NamedTemporaryFile("r", suffix=".time") as f:
        e = dict(env())
        p = subprocess.run(["/usr/bin/time", "-o", f.name, "-f", "%M", sys.executable, "-c", TRAIN, str(T), impl,
                            recompute, str(block_size or T)],
                           env=e, capture_output=True, text=True, timeout=1800, cwd=ROOT)
        if p.returncode != 0:
            raise RuntimeError(f"T={T} {impl}: {p.stderr[-1500:]}")
        return int(f.read().split()[-1]) * 1024


def run(a):
    from pympar import kernels
    if not kernels.native_available():
        raise SystemExit("bench/attention.py: the tiled attention kernel needs pympar._C built in this checkout "
                         f"({ROOT}): pip install -e . in the checkout first")
    quick = a.quick
    shapes = [(256, 4, 32)] if quick else [(1024, 4, 32), (4096, 4, 32), (1024, 12, 64)]
    threads = [1] if quick else [1, 2]
    if a.memory_only:
        res = json.loads(Path(a.json).read_text())
        res["machine"] = machine()
    else:
        res = dict(machine=machine(), speed=speed(shapes, threads, 2 if quick else a.reps))
    try:
        import torch
        res["torch_version"] = torch.__version__
    except ImportError:
        pass
    mem = []
    lengths = [128, 256] if quick else [1024, 2048, 4096]
    for T in lengths:
        row = dict(T=T)
        for impl in ("tiled", "materialized"):
            row[f"{impl}_peak_bytes"] = peak_rss(T, impl)
        for rc in ("selective", "full"):
            row[f"tiled_{rc}_peak_bytes"] = peak_rss(T, "tiled", rc)
        row["tiled_one_model_peak_bytes"] = peak_rss(T, "tiled", block_size=lengths[-1])
        mem.append(row)
        print(f"2-layer 128-wide model, micro-batch 1, T {T}: peak RSS tiled {row['tiled_peak_bytes'] / 2**20:.0f} MiB, "
              f"materialized {row['materialized_peak_bytes'] / 2**20:.0f} MiB, tiled with --recompute selective "
              f"{row['tiled_selective_peak_bytes'] / 2**20:.0f} MiB, full {row['tiled_full_peak_bytes'] / 2**20:.0f} MiB; "
              f"tiled, block_size {lengths[-1]}: {row['tiled_one_model_peak_bytes'] / 2**20:.0f} MiB",
              flush=True)
    res["memory"] = mem
    res["memory_when"] = time.strftime("%Y-%m-%d %H:%M")
    from pympar.kernels import gemm              # the processes' GEMM library (MKL adds ~13 MiB to each)
    res["memory_gemm"] = gemm.describe()
    growth = mem[-1]["tiled_peak_bytes"] / mem[0]["tiled_peak_bytes"]
    res["tiled_peak_growth"] = dict(from_T=mem[0]["T"], to_T=mem[-1]["T"], ratio=growth, target=1.5)
    for rc in ("selective", "full", "one_model"):
        res[f"tiled_{rc}_peak_growth"] = mem[-1][f"tiled_{rc}_peak_bytes"] / mem[0][f"tiled_{rc}_peak_bytes"]
    print(f"tiled peak at T {mem[-1]['T']} / at T {mem[0]['T']}: {growth:.2f}x (target <= 1.5x); with selective "
          f"recomputation {res['tiled_selective_peak_growth']:.2f}x, full {res['tiled_full_peak_growth']:.2f}x; one model "
          f"(block_size {lengths[-1]}) at both lengths, no recomputation: {res['tiled_one_model_peak_growth']:.2f}x")
    return res


def plot(res, png):
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    sp = res["speed"]
    labels = [f"T{r['T']} {r['heads']}x{r['head_size']}\n{r['threads']} thr" for r in sp]
    x = np.arange(len(sp))
    for j, (k, c, lab) in enumerate((("tiled", "tab:blue", "pympar tiled"), ("materialized", "tab:gray", "pympar materialized"),
                                     ("sdpa", "tab:orange", "torch SDPA"))):
        a1.bar(x + (j - 1) * 0.27, [r[f"{k}_gflops"] for r in sp], width=0.27, color=c, label=lab)
    a1.set_xticks(x, labels, fontsize=6)
    a1.set(ylabel="GFLOP/s (7 T^2 D per head)", title="attention forward + backward, batch 1, float32")
    a1.legend(fontsize=6)
    mem = res["memory"]
    Ts = [r["T"] for r in mem]
    for k, c, lab in (("tiled", "tab:blue", "tiled"), ("materialized", "tab:gray", "materialized"),
                      ("tiled_selective", "tab:olive", "tiled, --recompute selective"),
                      ("tiled_full", "tab:green", "tiled, --recompute full"),
                      ("tiled_one_model", "tab:purple", "tiled, block_size = longest T")):
        if f"{k}_peak_bytes" not in mem[0]:
            continue
        a2.plot(Ts, [r[f"{k}_peak_bytes"] / 2**20 for r in mem], "o-", color=c, label=lab)
    a2.set(xlabel="sequence length T", ylabel="peak RSS (MiB)", title="2-layer, 128-wide model, micro-batch 1")
    a2.set_xscale("log", base=2)
    a2.legend(fontsize=6)
    fig.suptitle(res["machine"], fontsize=7)
    fig.tight_layout()
    save(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T 256, 1 thread, memory at T 128/256 (seconds)")
    ap.add_argument("--reps", type=int, default=5, help="calls per measurement (the best is kept)")
    ap.add_argument("--memory-only", action="store_true",
                    help="measure the memory only; the speed rows come from the --json file of an earlier run")
    return run_and_write(ap, argv, "attention", run, plot)


if __name__ == "__main__":
    main()
