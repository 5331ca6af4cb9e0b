"""docs/benchmarks.md from the JSON under bench/results/ (written by bench/run_all.py).

Every number in the document is read from the JSON the run wrote; nothing is typed in.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path


def _load(res: Path, name: str):
    p = res / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _img(name: str, alt: str) -> str:
    return f"![{alt}](img/{name}.png)\n"


def _missing(name, status) -> str:
    s = status.get(name)
    if s and not s["ok"]:
        return f"*Step `{name}` FAILED in the last run:*\n\n```\n{(s.get('log_tail') or '')[-800:]}\n```\n"
    return f"*No results yet: run `python bench/run_all.py --only {name}`.*\n"


def _when(name, status) -> str:
    s = status.get(name)
    return f" (run {s['when']}, {s['seconds']:.0f} s{', --quick' if s.get('quick') else ''})" if s else ""


def _opening(res: Path, status, name: str, title: str):
    """A section's JSON (None when the step wrote none) and its opening lines: the title with when
    the step last ran and a blank line -- or, without the JSON, the title and what became of the step."""
    d = _load(res, name)
    head = title + _when(name, status)
    return d, ([head, ""] if d else [head, _missing(name, status)])


def _cell(r: dict, key: str, fmt: str) -> str:
    """r[key] formatted, "-" for a row that predates the field."""
    return format(r[key], fmt) if key in r else "-"


def human(b) -> str:
    for u, s in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if b >= u:
            return f"{b / u:g} {s}"
    return f"{b} B"


def sec_collectives(res, status) -> str:
    d, out = _opening(res, status, "collectives", "## Collectives: pympar vs the MPI library vs torch.distributed gloo")
    if not d:
        return "\n".join(out)
    out += ["`python bench/collectives.py` runs `python -m pympar.bench <collective> --algo all --json` for every "
            "rank count: each pympar algorithm, the library's own call through mpi4py (`library`) and, for allreduce, "
            "gloo (`torch-gloo`), in one run per (collective, ranks). busbw follows nccl-tests. The tables give, per "
            "size, the library's time, the fastest pympar algorithm and its speed relative to the library "
            "(t_library / t_pympar: > 1 means pympar is faster), and gloo's. Allreduce in place (gloo's only mode), "
            "the rest out of place.", ""]
    for coll in dict.fromkeys(s["collective"] for s in d["summary"]):
        out += [f"### {coll}", "", _img(f"collectives_{coll}", coll), ""]
        ns = sorted({s["nranks"] for s in d["summary"] if s["collective"] == coll})
        for n in ns:
            rs = [s for s in d["summary"] if s["collective"] == coll and s["nranks"] == n]
            out += [f"{n} ranks:", "", "| size | library us | best pympar | its us | pympar / library speed | gloo / library speed |",
                    "| ---: | ---: | --- | ---: | ---: | ---: |"]
            for s in rs:
                g = f"{s['gloo_speedup_vs_library']:.2f}x" if s.get("gloo_speedup_vs_library") else "-"
                out.append(f"| {human(s['bytes'])} | {s['library_us']:.0f} | {s['best_algo']} | {s['best_us']:.0f} | "
                           f"{s['best_speedup_vs_library']:.2f}x | {g} |")
            sp = [s["best_speedup_vs_library"] for s in rs]
            out += ["", f"Median over sizes of the best pympar algorithm's speed relative to the library: "
                        f"{statistics.median(sp):.2f}x (range {min(sp):.2f}x to {max(sp):.2f}x).", ""]
    wrong = sum(r["wrong"] for r in d["rows"] if r["wrong"] > 0)
    out.append(f"Elements off the NumPy reference over all checked rows (sizes below 4 MiB): {wrong}.\n")
    return "\n".join(out)


def sec_auto_select(res, status) -> str:
    d, out = _opening(res, status, "auto_select", "## algo=\"auto\" against every choice, on shared memory and on the network transport"
          )
    if not d:
        return "\n".join(out)
    tgt = d.get("target", 1.15)
    out += ["`python bench/auto_select.py`: one `python -m pympar.bench allreduce --algo all` run per transport and "
            "rank count (auto measures its choice per size bucket in its warm-up, agreed over the ranks). Per size, "
            "best = the fastest row of the run (every pympar algorithm, `mpi` = pympar's wrapper of the library's "
            "nonblocking call, `library` = MPI_Allreduce called directly through mpi4py). auto/best: auto's row "
            "over the best; chosen/best: the row of the algorithm auto chose over the best (the decision without "
            "the noise between two rows of one algorithm). Out of place, the slowest rank's mean, in the fastest of "
            f"{d.get('rounds', 1)} alternating round(s) (`--rounds`: every row timed once per round, so two rows "
            "are compared at the same moments of the run). Transports: "
            "`shm` MPICH's default (shared memory); `network` `MPIR_CVAR_NOLOCAL=1` (every message through the "
            "network module, each rank its own node); `2nodes` `MPIR_CVAR_NUM_CLIQUES=2` (two nodes sharing memory "
            "inside, network between). Ranks beyond 2 oversubscribe the 2 cores.", ""]
    if any("auto_over_best_median" in s for s in d["summary"]):
        out += [_img("auto_allreduce_bars", "auto over the best row, every point"), ""]
    summ = d["summary"]
    for tr in dict.fromkeys(s["transport"] for s in summ):
        out += [f"### {tr}", "", _img(f"auto_allreduce_{tr}", f"auto on {tr}"), ""]
        ns = sorted({s["nranks"] for s in summ if s["transport"] == tr})
        sizes = sorted({s["bytes"] for s in summ if s["transport"] == tr})
        out += ["| size | " + " | ".join(f"{n} ranks: auto (chosen) | auto/best | chosen/best | library/auto"
                                         for n in ns) + " |",
                "| ---: |" + " --- | ---: | ---: | ---: |" * len(ns)]
        for b in sizes:
            cells = []
            for n in ns:
                s = next((x for x in summ if x["transport"] == tr and x["nranks"] == n and x["bytes"] == b), None)
                if s is None:
                    cells.append("- | - | - | -")
                    continue
                c = s.get("chosen_row_over_best")
                cells.append(f"{s['auto_us']:.1f} us ({s['chosen']}) | {s['auto_over_best']:.2f} | "
                             f"{'-' if c is None else f'{c:.2f}'} | {s['library_over_auto']:.2f}")
            out.append(f"| {human(b)} | " + " | ".join(cells) + " |")
        within = [s for s in summ if s["transport"] == tr]
        ok = sum(1 for s in within if s["auto_over_best"] <= tgt)
        okc = sum(1 for s in within if (s.get("chosen_row_over_best") or 9) <= tgt)
        same = [s["auto_over_chosen_row"] for s in within if s.get("auto_over_chosen_row")]
        noisy = sum(1 for r in same if max(r, 1 / r) > tgt)
        okm = sum(1 for s in within if s.get("auto_over_best_median", 9) <= tgt)
        out += ["", f"auto within {tgt}x of the best: {ok} of {len(within)} (size, ranks) points; the chosen "
                    f"algorithm's own row within {tgt}x: {okc} of {len(within)}"
                + (f"; by each row's median round instead of its fastest: {okm} of {len(within)}."
                   if any("auto_over_best_median" in s for s in within) else ".")
                + (f" The benchmark's own noise: auto's row and the row of the algorithm it ran (two timings of "
                   f"one algorithm) differ by more than {tgt}x at {noisy} of {len(same)} points." if same else ""), ""]
    return "\n".join(out)


def sec_train_step(res, status) -> str:
    d, out = _opening(res, status, "train_step", "## A training step: pympar vs PyTorch eager + SDPA and torch.compile")
    if not d:
        return "\n".join(out)
    table = d.get("table", {})
    out += ["`python bench/train_step.py`: forward, backward and AdamW of the same model with the same weights and "
            "threads in one process, pympar interleaved with each PyTorch peer a user would pick: eager with "
            "`F.scaled_dot_product_attention`, `torch.compile` of that model, and eager with hand-written "
            f"attention (torch {d.get('torch_version', '?')}). Speed ratios are pympar's tokens/s over the peer's "
            "(> 1: pympar faster), the median of the rounds (`--repeat`). MFU/sgemm: model FLOP/s (PaLM's "
            "6N + 12LCT per token, attention included) over this process's measured float32 GEMM rate on the "
            "step's largest GEMM at the same threads (the faster of NumPy's BLAS and pympar's products: MKL where "
            "installed, src/pympar/kernels/gemm.py). GEMM: the library pympar's products ran on (rows without one "
            "predate the choice: NumPy's BLAS).", "", _img("train_step", "training step"), "",
            "| shape | threads | GEMM | sgemm GFLOP/s | pympar tokens/s | pympar MFU/sgemm | x SDPA | x compile | x naive | "
            "SDPA MFU/sgemm |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *[f"| {key.rsplit('/', 1)[0]} | {key.rsplit('/', 1)[1]} | {r.get('gemm_library', '-')} | "
              f"{_cell(r, 'sgemm_gflops', '.0f')} | {r['pympar_tokens_per_s']:.0f} | {_cell(r, 'pympar_mfu_vs_sgemm', '.2f')} | "
              f"{_cell(r, 'sdpa_speed_ratio', '.2f')} | {_cell(r, 'compile_speed_ratio', '.2f')} | "
              f"{_cell(r, 'naive_speed_ratio', '.2f')} | {_cell(r, 'sdpa_mfu_vs_sgemm', '.2f')} |"
              for key, r in sorted(table.items()) if not key.endswith("/bf16")],
            *_train_step_bf16(table),
            "", "docs/engine.md has the profile of pympar's step.",
            "", "The data-parallel form of this comparison (pympar DP against torch DDP) is the next section.", ""]
    return "\n".join(out)


def _train_step_bf16(table) -> list:
    """The bf16 rows (issue 43): pympar's mixed precision against the peers under CPU autocast."""
    rows = sorted((k, r) for k, r in table.items() if k.endswith("/bf16"))
    if not rows:
        return []
    return ["", "### bfloat16: pympar's mixed precision vs PyTorch CPU autocast", "",
            "`python bench/train_step.py --dtype bfloat16`: pympar with float32 master weights, gradients and AdamW and "
            "bf16 activations and products (docs/precision.md), against the same PyTorch peers with the forward under "
            "`torch.autocast(\"cpu\", dtype=torch.bfloat16)`, and against pympar in float32, same weights and threads, "
            "interleaved. MFU/bf16: model FLOP/s over the faster bf16 GEMM rate (bf16 operands, bf16 out) of the "
            "step's largest GEMM shape in this process and round: pympar's (`nn.products.linear_bf16`) or PyTorch's "
            "(`F.linear` on bf16 tensors). On this VM the rate of the AMX units moved between about 0.55 and 2.3 "
            "TFLOP/s from one minute to the next (an L1-resident micro-kernel), so MFU figures move with it; the "
            "speed ratios are paired within a round.", "",
            "| shape | threads | bf16 products | bf16 GEMM GFLOP/s (pympar / PyTorch) | pympar tokens/s | MFU/bf16 | "
            "x autocast SDPA | x autocast compile | x pympar float32 |",
            "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
            *[f"| {k.split('/')[0]} | {k.split('/')[1]} | {r.get('bf16_engine', '-')} | "
              f"{_cell(r, 'bf16_gemm_pympar_gflops', '.0f')} / {_cell(r, 'bf16_gemm_torch_gflops', '.0f')} | "
              f"{r['pympar_tokens_per_s']:.0f} | {_cell(r, 'pympar_mfu_vs_bf16_gemm', '.2f')} | "
              f"{_cell(r, 'sdpa_speed_ratio', '.2f')} | {_cell(r, 'compile_speed_ratio', '.2f')} | "
              f"{_cell(r, 'pympar_f32_speed_ratio', '.2f')} |" for k, r in rows]]


def sec_attention(res, status) -> str:
    d, out = _opening(res, status, "attention", "## Causal attention: the tiled kernel vs the materialized path vs PyTorch SDPA")
    if not d:
        return "\n".join(out)
    out += ["`python bench/attention.py`: forward + backward of the attention core alone (qkv to output to dqkv), batch 1, "
            "float32, each the best of several calls, interleaved in one process at the same thread count: pympar's tiled "
            "kernel (the default on NumPy; csrc/attention.cpp), pympar's materialized path (the (T, T) probabilities) and "
            f"`F.scaled_dot_product_attention(is_causal=True)` (torch {d.get('torch_version', '?')}). GFLOP/s count "
            "7 T^2 D per head.", "", _img("attention", "attention speed and memory"), "",
            "| T | heads x size | threads | tiled ms | materialized ms | SDPA ms | tiled GFLOP/s | tiled / SDPA speed |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            *[f"| {r['T']} | {r['heads']} x {r['head_size']} | {r['threads']} | {1e3 * r['tiled_s']:.1f} | "
              f"{1e3 * r['materialized_s']:.1f} | {1e3 * r['sdpa_s']:.1f} | {r['tiled_gflops']:.0f} | {r['tiled_over_sdpa']:.2f}x |"
              for r in d["speed"]],
            "", "Peak resident memory (VmHWM, from outside; " + (f"measured {d['memory_when']}, " if "memory_when" in d else "")
            + (f"GEMM {d['memory_gemm']} -- MKL's code and buffers add about 13 MiB to every row, so a ratio between rows "
               "is lower than with NumPy's BLAS for the same bytes of activations; " if "memory_gemm" in d else "")
            + "python bench/attention.py --memory-only measures it alone) of one process training the 2-layer, 128-wide model "
            "(4 heads, vocabulary 256) for 2 steps at micro-batch 1; block_size = T except in the last column, which "
            "trains one model (block_size the longest T) at every T:", "",
            "| T | tiled MiB | materialized MiB | tiled, `--recompute selective` MiB | tiled, `--recompute full` MiB "
            "| tiled, one model MiB |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
            *[f"| {r['T']} | {r['tiled_peak_bytes'] / 2**20:.0f} | {r['materialized_peak_bytes'] / 2**20:.0f} | "
              + " | ".join(f"{r[k] / 2**20:.0f}" if k in r else "--" for k in ("tiled_selective_peak_bytes", "tiled_full_peak_bytes",
                                                                      "tiled_one_model_peak_bytes"))
              + " |" for r in d["memory"]]]
    g = d["tiled_peak_growth"]

    def verdict(x):
        return f"{x:.2f}x ({'met' if x <= g['target'] else 'missed'})"
    rc = [f"with {k} recomputation {verdict(d[f'tiled_{k}_peak_growth'])}" for k in ("selective", "full")
          if f"tiled_{k}_peak_growth" in d]
    if "tiled_one_model_peak_growth" in d:
        rc.append("one model (block_size the longest T, so its position table is the same size at both lengths) "
                  f"without recomputation {verdict(d['tiled_one_model_peak_growth'])}")
    out += ["", f"Tiled peak at T {g['to_T']} over its peak at T {g['from_T']} (target at most {g['target']}x): "
                f"**{verdict(g['ratio'])}** without recomputation" + "".join(f"; {x}" for x in rc) + ".", ""]
    return "\n".join(out)


def sec_gemm(res, status) -> str:
    d, out = _opening(res, status, "gemm", "## The GEMMs of a step: NumPy's BLAS, pympar's products (MKL where installed) and PyTorch's")
    if not d:
        return "\n".join(out)
    out += ["`python bench/gemm.py`: every matrix product pympar's Linear layers and head run in one training step "
            "(forward y = x W^T, backward dx = dy W and dW = dy^T x, the operands laid out as pympar passes them), "
            f"timed on NumPy's BLAS ({d.get('blas_numpy', '?')}), on pympar's products ({d.get('pympar_gemm', 'not run')}; "
            "nn.products.matmul, src/pympar/kernels/gemm.py) and on PyTorch's "
            f"(torch {d.get('torch_version', '?')}; what its eager and compiled steps call) at the same threads in one "
            "process, the libraries alternating in blocks, each product the best of several calls. Attention's own "
            "products are not included (pympar's run inside its C++ kernel). Ratio > 1: PyTorch's BLAS faster. "
            "Rows without a pympar column predate the MKL path (pympar then ran NumPy's BLAS).", "",
            _img("gemm", "step GEMMs"), "",
            "| shape | threads | NumPy ms | pympar ms | torch ms | NumPy / pympar / torch GFLOP/s | torch / NumPy speed | "
            "torch / pympar speed |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
            *[f"| {r['shape']} | {r['threads']} | {r['numpy_ms']:.1f} | {_cell(r, 'pympar_ms', '.1f')} | {r['torch_ms']:.1f} | "
              f"{r['numpy_gflops']:.0f} / {_cell(r, 'pympar_gflops', '.0f')} / {r['torch_gflops']:.0f} | "
              f"{r['torch_over_numpy']:.2f}x | {_cell(r, 'torch_over_pympar', '.2f')}x |" for r in d["rows"]], ""]
    return "\n".join(out)


def sec_pipeline_head(res, status) -> str:
    d, out = _opening(res, status, "pipeline_head", "## The last pipeline stage's head in one pass vs forward and backward apart")
    if not d:
        return "\n".join(out)
    pr = d["pair_ratios"]
    out += ["`mpiexec -n 2 python bench/pipeline_head.py`: 1F1B over 2 ranks, real GPT blocks and a GPT-2-sized "
            "vocabulary; the last stage runs the head's forward and backward in F's one pass (each chunk's logits "
            "computed once) or apart (the logits computed again in B), the two alternating step by step in one run, "
            f"{d.get('threads', '?')} thread(s) per rank. docs/pipeline.md explains the path.", "",
            "| shape | one pass s/step | apart s/step | apart / one pass | pairs | same loss |",
            "| --- | ---: | ---: | ---: | --- | --- |",
            f"| {d['shape']} | {d['one_pass_s']:.3f} | {d['apart_s']:.3f} | {d['ratio']:.2f}x | "
            f"{min(pr):.2f}-{max(pr):.2f}x | {d['same_loss']} |", ""]
    return "\n".join(out)


def sec_ddp_step(res, status) -> str:
    d, out = _opening(res, status, "ddp_step", "## A data-parallel step: pympar DP vs torch DDP (gloo)")
    if not d:
        return "\n".join(out)
    out += ["`python bench/ddp_step.py`: pympar's data-parallel step (the trainer's ParallelRunner: bucketed "
            "gradient allreduce overlapped with backward) against PyTorch DistributedDataParallel on gloo "
            f"(torch {d['torch_version']}), both launched by mpiexec with the same process count, one thread per "
            f"process, the same model and weights, the same micro-batch per rank (global batch {d['global_batch']} "
            "sequences), clip 1.0 and AdamW. Per launch: median of the slowest rank's step time over "
            f"{d['steps']} steps after {d['warmup']}; the sides alternate launch by launch for {d['rounds']} "
            "round(s), and the ratio is the median of the rounds' ratios (> 1: pympar faster). Both sides' "
            "global mean loss at step 0 (same weights, same batch) and at step 1 (after one synchronised "
            "update) show the two runs do the same work.", "", _img("ddp_step", "ddp step"), "",
            "| preset | ranks | batch per rank x seq | pympar tokens/s | torch DDP tokens/s | pympar / torch | each round | "
            "loss step 0 pympar / torch | loss step 1 pympar / torch |",
            "| --- | ---: | --- | ---: | ---: | ---: | --- | --- | --- |"]
    for r in d["rows"]:
        l1 = f"{r['loss1_pympar']:.6f} / {r['loss1_torch']:.6f}" if r.get("loss1_pympar") is not None else "-"
        each = ", ".join(f"{x['ratio']:.2f}" for x in r["rounds"])
        out.append(f"| {r['preset']} | {r['world']} | {r['per_rank_batch']} x {r['seq']} | {r['pympar_tokens_per_s']:.0f} | "
                   f"{r['torch_tokens_per_s']:.0f} | {r['ratio']:.2f}x | {each} | "
                   f"{r['loss0_pympar']:.6f} / {r['loss0_torch']:.6f} | {l1} |")
    fu = [f"{r['preset']} {r['world']} ranks" for r in d["rows"] if r.get("torch_find_unused_parameters")]
    if fu:
        out += ["", f"Torch DDP runs {', '.join(fu)} with find_unused_parameters=True (an expert that gets no token on "
                    "a rank has no gradient in the autograd graph, which DDP otherwise refuses): an extra walk of the "
                    "graph per step on the torch side only; pympar allreduces that expert's zero gradients."]
    bad = [r for r in d["rows"] if not r["same_loss"]]
    out += ["", "Step-0 losses agree within a relative " + f"{d['loss_rtol']:g} in " +
            ("every row." if not bad else f"{len(d['rows']) - len(bad)} of {len(d['rows'])} rows: the rows "
             + ", ".join(f"{r['preset']} {r['world']} ranks" for r in bad) + " do NOT compare the same work."), ""]
    return "\n".join(out)


def sec_kernels(res, status) -> str:
    d, out = _opening(res, status, "kernels", "## Kernels: C++ against the NumPy reference")
    if not d:
        return "\n".join(out)
    out += ["`python bench/cpu_kernels.py` (details and the per-call overhead in docs/kernels.md).", "",
            _img("kernels", "kernels"), "", "| kernel | elements | " + " | ".join(f"{t} thread(s) speed-up" for t in d["threads"]) + " |",
            "| --- | ---: |" + " ---: |" * len(d["threads"])]
    for r in d["results"]:
        out.append(f"| {r['kernel']} | {r['elements']:,} | " + " | ".join(f"{r['native'][str(t)]['speedup']:.1f}x" for t in d["threads"]) + " |")
    return "\n".join(out) + "\n"


def sec_strategies(res, status) -> str:
    d, out = _opening(res, status, "strategies", "## Strategies: DP, PP, DP+PP, TP, EP for one model, rank count and global batch")
    if not d:
        return "\n".join(out)
    out += ["`python bench/strategies.py`: real `python -m pympar.train` runs, dense `small` (4 layers, C=128) and "
            f"MoE `moe-small`; median tokens/s over {d['steps']} steps after warm-up, each layout run {d.get('rounds', 1)} "
            "time(s) with the rounds interleaved (the median run is kept). Ratios are against DP alone of the same model.",
            "", _img("strategies", "strategies"), "",
            "| ranks | layout | tokens/s | vs DP alone | MFU | compute | dp comm | tp comm | pp comm | ep comm | bubble |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        if r["status"] != "ok":
            out.append(f"| {r['world']} | {r['label']} | not yet | | | | | | | | |")
            continue
        s = r["split"]
        out.append(f"| {r['world']} | {r['label']} | {r['tokens_per_s']:.0f} | {r.get('vs_dp', float('nan')):.2f}x | "
                   f"{100 * r['mfu']:.0f}% | " + " | ".join(f"{100 * s[k]:.0f}%" for k in
                                                          ("compute", "dp_comm", "tp_comm", "pp_comm", "ep_comm", "bubble")) + " |")
    bad = [r for r in d["rows"] if r["status"] != "ok"]
    if bad:
        out += ["", "Not yet runnable: " + "; ".join(f"{r['label']} ({r['error'][:160]})" for r in bad)]
    return "\n".join(out) + "\n"


def sec_pipeline(res, status) -> str:
    d, out = _opening(res, status, "pipeline", "## Pipeline bubble against micro-batch count")
    if not d:
        return "\n".join(out)
    out += ["`python bench/pipeline.py --launch` (emulated blocks of fixed duration; docs/pipeline.md has the "
            "latency-aware model). Measured bubble against (p-1)/(m+p-1) (interleaved: (p-1)/(vm+p-1)); the grey "
            "line marks the rule of thumb m = 4p.", "", _img("pipeline", "pipeline"), "",
            "| schedule | p | m | measured bubble | formula | measured / formula |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        ratio = r["bubble_mean"] / r["formula"] if r["formula"] else float("nan")
        out.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['bubble_mean']:.3f} | {r['formula']:.3f} | {ratio:.2f} |")
    return "\n".join(out) + "\n"


def sec_dp(res, status) -> str:
    d, out = _opening(res, status, "dp_scaling", "## Data-parallel weak scaling and overlap")
    if not d:
        return "\n".join(out)
    out += ["`python bench/dp_scaling.py --launch` (method in docs/parallel.md): same micro-batches per rank, overlap "
            "on and off alternating step by step in one run.", "", _img("dp_scaling", "dp scaling"), "",
            "| dp | overlap | step / dp=1 | sync hidden behind backward | MB sent |", "| ---: | --- | ---: | ---: | ---: |"]
    for r in d["results"]:
        out.append(f"| {r['dp']} | {'on' if r['overlap'] else 'off'} | {r['slowdown_vs_dp1']:.2f} | "
                   f"{100 * r['hidden']:.0f}% | {r['bytes_sent'] / 2**20:.2f} |")
    return "\n".join(out) + "\n"


def sec_moe(res, status) -> str:
    d, out = _opening(res, status, "moe_balance", "## MoE load balance")
    if not d:
        return "\n".join(out)
    ranks = f"ep = {d['ep']} ranks" if d.get("ep") else f"{d['world']} DP ranks"
    out += [f"`python bench/moe_balance.py`: `{d['preset']}` with {d['n_expert']} experts, top-{d['top_k']}, "
            f"{ranks}, {d['steps']} steps, same data and seed; loads are the trainer's global "
            f"tokens-per-expert per step. Aux loss: aux_coef {d['aux_coef']}; aux-loss-free: bias_update_rate "
            f"{d['bias_update_rate']} (sign update after every step), aux_coef 0"
            + (f"; replicas: {d['replicas']} slot(s) per rank placed every {d['replan_every']} steps, aux_coef 0"
               if d.get("replicas") else "") + ". Std and CV are means over the second half of the run; rank "
            "max/mean: the rows each ep rank ran over their mean.", "",
            _img("experts" if d.get("ep") else "moe_balance", "moe balance"), "",
            "| balancing | std of tokens/expert | CV | CV vs none | rank max/mean | training loss (last 10) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for o in d["results"]:
        rk = f"{o['rank_second_half']:.2f}" if "rank_second_half" in o else "-"
        out.append(f"| {o['variant']} | {o['std_second_half']:.1f} | {o['cv_second_half']:.3f} | {o['cv_vs_none']:.2f}x | "
                   f"{rk} | {o['loss_last10']:.4f} |")
    return "\n".join(out) + "\n"


def sec_moe_experts(res, status) -> str:
    d, out = _opening(res, status, "moe_experts", "## Grouped expert products")
    if not d:
        return "\n".join(out)
    out += [f"`python bench/moe_experts.py`: a rank's local experts (C {d['width']}, hidden {d['hidden']}), forward and "
            f"backward of every expert MLP over rows split by a Zipf law (exponent {d['zipf']}), the per-expert loop "
            "against the grouped call (csrc/grouped.cpp, the same products: bitwise the same results), and PyTorch "
            "eager's per-expert loop under autograd on the same rows.", "", _img("moe_experts", "grouped experts"), "",
            "| dtype | rows | experts | threads | loop ms | grouped ms | grouped speed-up | PyTorch loop ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        t = f"{r['torch_ms']:.2f}" if r.get("torch_ms") is not None else "-"
        out.append(f"| {r.get('dtype', d.get('dtype'))} | {r['rows']} | {r['n_expert']} | {r['threads']} | {r['loop_ms']:.2f} | "
                   f"{r['grouped_ms']:.2f} | {r['speedup']:.2f}x | {t} |")
    return "\n".join(out) + "\n"


def sec_moe_dispatch(res, status) -> str:
    d, out = _opening(res, status, "moe_dispatch", "## Expert dispatch: flat alltoallv against the node-aware route")
    if not d:
        return "\n".join(out)
    out += [f"`python bench/moe_dispatch.py`: one MoE layer's token exchange (dispatch and combine, identity "
            f"experts) of {d['tokens']} tokens x {d['width']} float32 per rank over {d['experts']} experts, top-k to "
            "distinct experts drawn uniformly; `shm`: nodes simulated by PYMPAR_RANKS_PER_NODE (all shared memory); "
            "`network`: MPIR_CVAR_NUM_CLIQUES (MPICH's network module between the cliques). Bytes across nodes: both "
            "directions, all ranks. Time: the slowest rank's, median over rounds; more than 2 ranks oversubscribe "
            "the 2 cores.", "", _img("moe_dispatch", "moe dispatch"), "",
            "| transport | nodes x ranks | top-k | MiB across nodes, flat | node-aware / flat | flat ms | node ms | speed-up |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        out.append(f"| {r['transport']} | {r['nodes']} x {r['ranks_per_node']} | {r['top_k']} | "
                   f"{r['flat_bytes_across'] / 2**20:.1f} | {r['bytes_ratio']:.2f}x | {1e3 * r['flat_s']:.2f} | "
                   f"{1e3 * r['node_s']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(out) + "\n"


def sec_moe_replicas(res, status) -> str:
    d, out = _opening(res, status, "moe_replicas", "## Replicated hot experts")
    if not d:
        return "\n".join(out)
    out += [f"`python bench/moe_replicas.py`: a MoE GPT with 4 experts per rank, expert parallelism over all ranks, "
            f"a router skewed by a selection bias of {d['skew']} per log popularity rank, {d['steps']} training steps "
            "without replicas (the loads), then the same steps from the same model with replicas placed from those "
            "loads. Rows per rank: the rows each rank's experts ran, max over mean, the worst step and layer.", "",
            _img("moe_replicas", "moe replicas"), "",
            "| ep | expert max/mean (no replicas) | replica slots per rank | rows per rank max/mean: mean over steps, "
            "worst step | step ms | "
            "speed-up | generate s | speed-up | losses' largest relative difference |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for g in d["runs"]:
        for r in g["rows"]:
            out.append(f"| {g['ep']} | {max(g['expert_max_over_mean']):.2f} | {r['slots']} | "
                       f"{r['rank_max_over_mean_mean']:.2f}, {r['rank_max_over_mean']:.2f} | "
                       f"{1e3 * r['step_s']:.1f} | {r['speedup']:.2f}x | {r['generate_s']:.2f} | "
                       f"{r['generate_speedup']:.2f}x | {r['loss_rel_diff']:.1e} |")
    return "\n".join(out) + "\n"


def sec_moe_fold(res, status) -> str:
    d, out = _opening(res, status, "moe_fold", "## Experts folded apart from tensor parallelism")
    if not d:
        return "\n".join(out)
    one = d["single_process"]
    out += [f"`python bench/moe_fold.py`: `python -m pympar.train {' '.join(d['model'])}` (float32, AdamW, "
            f"{d['steps']} steps), attention on tp 2 x dp {d['rows'][0]['world'] // 2}, the experts on the grids below; "
            "peak resident memory per rank measured from outside (VmHWM), expert parameters per rank by arithmetic, "
            "step time the median after the first step (ranks share 2 cores: compare rows with each other). The single "
            f"process on the same batch peaks at {one['peak'] / 2**30:.2f} GiB.", "", _img("moe_fold", "moe fold"), "",
            "| experts | flags | expert params / rank | peak max (GiB) | peak min | vs ep 1 | step ms | vs ep 1 | "
            "losses vs 1 process |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        out.append(f"| {r['label']} | `{r['flags']}` | {r['expert_params_per_rank'] / 1e6:.2f} M | "
                   f"{r['peak_max'] / 2**30:.3f} | {r['peak_min'] / 2**30:.3f} | {r['peak_vs_ep1']:.2f}x | "
                   f"{1e3 * r['step_s']:.0f} | {r['step_vs_ep1']:.2f}x | {r['max_rel_loss_diff']:.1e} |")
    return "\n".join(out) + "\n"


def sec_compression(res, status) -> str:
    d, out = _opening(res, status, "compression", "## Gradient compression")
    if not d:
        return "\n".join(out)
    out += [f"`python bench/compression.py` (runs of bench/dp_scaling.py --curves): dp=2, preset tiny, "
            f"{d['steps']} AdamW steps; loss = mean of the last 10 steps.", "", _img("compression", "compression"), "",
            "| compress | KB sent / step | bytes vs dense | bytes saved | loss (last 10) | loss cost vs dense |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["results"]:
        out.append(f"| {r['compress']} | {r['bytes_sent'] / 1024:.1f} | {r['bytes_ratio']:.3f}x | {100 * r['bytes_saved']:.0f}% | "
                   f"{r['last10']:.3f} | {r['loss_cost']:+.3f} |")
    return "\n".join(out) + "\n"


def _null(ok):
    """(world, rho, 95th percentile of rho under permuted predictions) per rank count."""
    import sys
    from common import ROOT
    from pympar.plan.cli import spearman, spearman_null_p95
    out = []
    for w in sorted({r["world"] for r in ok}):
        pred, meas = [r["predicted_s"] for r in ok if r["world"] == w], [r["measured_s"] for r in ok if r["world"] == w]
        out.append((w, spearman(pred, meas), spearman_null_p95(pred, meas)))
    return out


def sec_plan(res, status) -> str:
    d, out = _opening(res, status, "plan_accuracy", "## The planner against measurement")
    if not d:
        return "\n".join(out)
    ok = [r for r in d["rows"] if r["status"] == "ok"]
    rho = d["spearman"]
    runs = d.get("rounds", 1)
    out += ["`python bench/plan_accuracy.py` (and `pytest -m slow tests/test_plan_measured.py`): for each layout the "
            "trainer's ParallelRunner is built under mpiexec; every rank reports its parameter count, the bytes "
            "that stay allocated after two steps (tracemalloc: parameters, gradients, buckets, optimiser state) and "
            "the peak of a step above that (activations and temporaries), then the median of timed steps; "
            f"{runs} run(s) per layout, rounds interleaved, median kept (on: {d.get('machine', 'not recorded')}). "
            "`pympar.plan.cost.predict` gives the prediction "
            "(the model and each of its terms: src/pympar/plan/cli.py's docstring)" +
            (", with the CPU constants of bench/plan_calibrate.py (below), measured by microbenchmarks that are "
             "not the layouts ranked here." if isinstance(d.get("calibration"), dict) else
             " with the alpha-beta constants fitted to the allreduce rows of bench/results/collectives.json for "
             "the same rank count."), ""]
    out += _calibration(res, d)
    out += ["Spearman rank correlation of predicted against measured step time: " +
            ", ".join(f"{k} ranks {v:.2f}" if k != "pooled" else f"pooled {v:.2f}" for k, v in rho.items()) +
            f" over {len(ok)} layouts. Against a planner that ranks at random (95th percentile "
            "of rho over 2000 permutations of the same predictions): " + ", ".join(
                f"{w} ranks {'beats' if rho_w > p95 else 'does not beat'} it ({rho_w:.2f} vs {p95:.2f})"
                for w, rho_w, p95 in _null(ok)) + "; tests/test_plan_measured.py asserts this per rank count.",
            "", _img("plan_accuracy", "planner"), ""]
    for w in sorted({r["world"] for r in ok}):
        q = [r["measured_s"] / r["predicted_s"] for r in ok if r["world"] == w]
        out.append(f"- {w} ranks: measured / predicted step time, median {statistics.median(q):.2f}x "
                   f"(range {min(q):.2f}x to {max(q):.2f}x).")
    pr = [r["persistent_ratio"] for r in ok]
    ar = [r["activation_ratio"] for r in ok]
    out += [f"- Memory: parameters per rank exact in {sum(r['params_exact'] for r in ok)} of {len(ok)} layouts; "
            f"persistent bytes measured / predicted {min(pr):.2f}x to {max(pr):.2f}x (above 1.5x: "
            f"{', '.join(r['layout'] for r in ok if r['persistent_ratio'] > 1.5) or 'none'}; the model counts "
            f"params + grads + AdamW state only, not gradient buckets or communication buffers); activation "
            f"peak {min(ar):.2f}x to {max(ar):.2f}x.", "",
            "| ranks | layout | predicted ms | measured ms | runs ms | params exact | persistent meas/pred | activations meas/pred |",
            "| ---: | --- | ---: | ---: | --- | --- | ---: | ---: |"]
    for r in ok:
        rounds = ", ".join(f"{x * 1e3:.0f}" for x in r.get("measured_rounds", []))
        out.append(f"| {r['world']} | {r['layout']} | {r['predicted_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} | "
                   f"{rounds} | {'yes' if r['params_exact'] else 'NO'} | {r['persistent_ratio']:.2f} | "
                   f"{r['activation_ratio']:.2f} |")
    return "\n".join(out) + "\n"


def _calibration(res, acc) -> list:
    """The planner's CPU constants: bench/plan_calibrate.py's measurements (interleaved with the
    layouts' rounds, one set per rank count) and what pympar.plan made of them."""
    cals = acc.get("calibration")
    if not isinstance(cals, dict):
        return []
    out = ["Calibration (bench/plan_calibrate.py's microbenchmarks, one round before each round of layouts, "
           "medians): one process steps the model with m micro-batches of B sequences and the plane t = "
           "step_fixed + m micro_fixed + m B per_seq is fitted; the allreduce (`pympar.bench allreduce --algo "
           "auto`) runs at the layouts' rank count, oversubscribed as they are; so do the concurrent copies of the "
           "one-process run (compute slowdown: their step over the step alone) and the arrival spread (the wait for "
           "the last rank at a 4 KiB allreduce after a burst of compute, ms after bursts of ms; the planner uses "
           "the closest non-decreasing fit to these points).", "",
           "| ranks | step_fixed ms | micro_fixed ms | per_seq ms | matmul burst GFLOP/s | allreduce 8 B us | busbw GB/s "
           "| compute slowdown | arrival spread ms (after burst ms) |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for w, c in cals.items():
        sp, ar = c["single_process"], c["allreduce"][w]
        out.append(f"| {w} | {sp['step_fixed_s'] * 1e3:.1f} | {sp['micro_fixed_s'] * 1e3:.1f} | {sp['per_seq_s'] * 1e3:.2f} | "
                   f"{c['matmul_peak'] / 1e9:.1f} | {ar['alpha_s'] * 1e6:.0f} (rounds: "
                   f"{', '.join(f'{x[0] * 1e6:.0f}' for x in ar['rounds'])}) | {ar['busbw'] / 1e9:.2f} | "
                   f"{_cal_slowdown(c, w)} | {_cal_arrival(c, w)} |")
    for w, c in cals.items():
        lat = [x[0] for x in c["allreduce"][w]["rounds"]]
        if len(lat) > 1 and max(lat) > 10 * min(lat):
            out += ["", f"At {w} ranks the small allreduce's latency changed by {max(lat) / min(lat):.0f}x between "
                        "rounds (on this shared VM; the cause was not isolated): the median picks "
                        "one state, and layouts measured in the other are mispredicted by their allreduce count."]
    out += ["", "What pympar.plan made of them (src/pympar/plan/cli.py load_calibration):", "",
            "| ranks | matmul GFLOP/s | overhead us/block | elem ns | optimiser ns/param | alpha us/round | bus GB/s "
            "| compute slowdown |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for w, m in acc.get("constants", {}).items():
        out.append(f"| {w} | {m['peak'] / 1e9:.1f} | {m['overhead'] * 1e6:.0f} | {m['elem_time'] * 1e9:.2f} | "
                   f"{m['opt_per_param'] * 1e9:.2f} | {m['alpha'] * 1e6:.0f} | {m['intra_bw'] / 1e9:.2f} | "
                   f"{_slowdown(m):.2f} |")
    return out + [""]


def _slowdown(m: dict) -> float:
    """The planner's compute slowdown of a rank (pympar.plan.cost.Machine.oversubscription)."""
    from pympar.plan.cost import Machine
    return Machine(**m).oversubscription(m["ranks_per_node"])


def _cal_slowdown(c: dict, w: str) -> str:
    con = (c.get("contention") or {}).get(w)
    return f"{con['slowdown']:.2f}" if con else "-"


def _cal_arrival(c: dict, w: str) -> str:
    arr = (c.get("arrival") or {}).get(w)
    return ", ".join(f"{y * 1e3:.2f} ({x * 1e3:.1f})" for x, y in arr["points"]) if arr else "-"


def sec_soak(res, status) -> str:
    d, out = _opening(res, status, "soak", "## Soak: memory over a long run with checkpoints")
    if not d:
        return "\n".join(out)
    out += [f"`python bench/soak.py`: {d['world']} ranks, preset {d['preset']}, {d['steps']} steps, a checkpoint "
            f"every {d['save_every']} (keeping 2). Resident memory of every rank from the trainer's metrics "
            "(largest over ranks). Growth = median over the last tenth of the steps against the second tenth.", "",
            _img("soak", "soak"), "",
            "| memory | after warm-up | end | growth |", "| --- | ---: | ---: | ---: |",
            f"| anonymous (RssAnon), largest rank | {d['baseline_anon'] / 2**20:.1f} MiB | {d['end_anon'] / 2**20:.1f} MiB | {100 * d['growth_anon']:+.2f}% |",
            f"| VmRSS, largest rank | {d['baseline_max'] / 2**20:.1f} MiB | {d['end_max'] / 2**20:.1f} MiB | {100 * d['growth_max']:+.2f}% |",
            "", f"Verdict (anonymous memory growth <= {100 * d['max_growth']:.0f}%): **{'PASS' if d['passed'] else 'FAIL'}**. "
            "VmRSS also counts the file pages of the memory-mapped training corpus, which grow as sampling touches "
            "more of the file (a 1-rank run without checkpoints shows the same VmRSS slope while its anonymous "
            "memory stays flat): they are reclaimable page cache, not a leak.", ""]
    return "\n".join(out)


def sec_reproducible(res, status) -> str:
    d, out = _opening(res, status, "reproducible", "## Reproducible sums: their cost")
    if not d:
        return "\n".join(out)
    out += ["`python bench/reproducible.py`: `allreduce(x, reproducible=True)` (exact integer bins, docs/comm.md) "
            "against the default `allreduce` (auto) and `MPI_Allreduce` through mpi4py, float32 sum, out of place, "
            "the slowest rank's mean, interleaved per size; and the trainer's `--deterministic` against its default "
            "(tiny preset, dp = 2, median tokens/s of alternating runs).", "",
            "| ranks | size | library us | auto us | reproducible us | reproducible / auto | busbw GB/s: ring | "
            "reproducible |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *[f"| {r['ranks']} | {human(r['bytes'])} | {r['library_us']:.1f} | {r['auto_us']:.1f} | "
              f"{r['reproducible_us']:.1f} | {r['reproducible_over_auto']:.1f}x | "
              f"{r['ring_busbw_gbs']:.2f} | {r['reproducible_busbw_gbs']:.2f} |" if "ring_busbw_gbs" in r else
              f"| {r['ranks']} | {human(r['bytes'])} | {r['library_us']:.1f} | {r['auto_us']:.1f} | "
              f"{r['reproducible_us']:.1f} | {r['reproducible_over_auto']:.1f}x | - | {r['reproducible_busbw_gbs']:.2f} |"
              for r in d["collectives"]]]
    t = d.get("trainer")
    if t:
        out += ["", f"Trainer: {t['default_tokens_per_s']:,.0f} tokens/s by default, {t['deterministic_tokens_per_s']:,.0f} "
                    f"with --deterministic ({t['deterministic_over_default']:.2f}x).", ""]
    return "\n".join(out)


def sec_param_server(res, status) -> str:
    d, out = _opening(res, status, "param_server", "## The seed's parameter-server comparison")
    if not d:
        return "\n".join(out)
    out += ["`python bench/param_server.py`: one step's gradient synchronisation (float32, the gradient sharded over "
            "S server ranks: workers push, servers average and update, workers pull) against pympar's allreduce "
            "among the same W workers and the same update; the slowest rank's median over iterations, the two "
            "interleaved in one job of W + S ranks. Above 2 ranks the job oversubscribes the 2 cores: a rank "
            "waiting in MPI spins, so these rows measure the machine's scheduling as much as the traffic.", "",
            "| transport | workers | servers | size | parameter server ms | allreduce ms | PS / allreduce |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            *[f"| {r['transport']} | {r['workers']} | {r['servers']} | {human(r['bytes'])} | {r['ps_ms']:.2f} | "
              f"{r['allreduce_ms']:.2f} | {r['ps_over_allreduce']:.2f} |" for r in d["rows"]], ""]
    return "\n".join(out)


def sec_cp_comm(res, status) -> str:
    d, out = _opening(res, status, "cp_comm", "## Context parallelism's attention: the ring against Ulysses")
    if not d:
        return "\n".join(out)
    out += ["`python bench/cp_comm.py`: the attention core alone (batch 1, "
            f"{d['heads']} heads of {d['head_size']}, float32, 1 thread per rank), forward and backward of this rank's "
            "T/cp positions; bytes each rank hands MPI to send to other ranks (counted around isend and alltoall) "
            "against the closed forms in u = this rank's share of one activation (ring 6 (cp - 1) u on rank 0, "
            "5 (cp - 1) u on rank cp - 1; Ulysses 8 (cp - 1)/cp u on every rank); time: the median of the slowest "
            "rank's.", "",
            "| cp | T | attention | MiB sent, the most a rank | measured u, most / least | closed form u | "
            "fwd+bwd ms |",
            "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
            *[f"| {r['cp']} | {r['T']} | {r['comm']} | {r['bytes_per_rank'] / 2**20:.2f} | {r['measured_units']:.2f} / "
              f"{r['bytes_min_rank'] / r['unit_bytes']:.2f} | {r['closed_form_units']:.2f} / "
              f"{r.get('closed_form_min_units', r['closed_form_units']):.2f} | {1e3 * r['seconds']:.1f} |"
              for r in d["rows"]], ""]
    return "\n".join(out)


def sec_cp_hybrid(res, status) -> str:
    d, out = _opening(res, status, "cp_hybrid", "## Context parallelism on two simulated nodes: ring, Ulysses, a2a+ring")
    if not d:
        return "\n".join(out)
    out += ["`python bench/cp_comm.py --two-nodes`: the attention core alone at cp 4 as 2 nodes of 2 ranks "
            "(`PYMPAR_RANKS_PER_NODE=2`), on shared memory and with every message on MPICH's network module "
            "(`MPIR_CVAR_NOLOCAL=1`); a2a+ring runs Ulysses inside each node's pair and the ring across the nodes. "
            "Bytes across: every byte a rank hands MPI for a rank of the other node, summed over the ranks. "
            "Speed-up: the faster of ring and a2a's time over this row's (issue 48's target for a2a+ring: >= 1.2).", "",
            "| transport | T | attention | MiB sent per rank | MiB across the nodes | fwd+bwd ms | vs the faster pure |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
            *[f"| {r['transport']} | {r['T']} | {r['comm']} | {r['bytes_per_rank'] / 2**20:.2f} | "
              f"{r['bytes_across_nodes'] / 2**20:.2f} | {1e3 * r['seconds']:.1f} | {r['speedup_vs_best_pure']:.2f}x |"
              for r in d["rows"]], ""]
    return "\n".join(out)


def sec_dualpipe_ep(res, status) -> str:
    d, out = _opening(res, status, "dualpipe_ep", "## DualPipeV's overlap of the expert-parallel all-to-all")
    if not d:
        return "\n".join(out)
    out += ["`python bench/dualpipe_ep.py`: first the machine's limit -- 2 ranks (one per core), an all-to-all started "
            "nonblocking with 5 ms of GEMMs behind it (the compute's progress calls on and off), then its wait, "
            "against the blocking call (hidden = 1 - poked wait / blocking):", "",
            "| transport | MiB per rank | blocking ms | wait, no poke | wait, poked | hidden |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
            *[f"| {t['transport']} | {t['mb']:g} | {1e3 * t['blocking']:.2f} | {1e3 * t['behind, no poke']:.2f} | "
              f"{1e3 * t['behind, poked']:.2f} | {t['hidden_transfer']:.2f} |" for t in d.get("transfer", [])], "",
            f"Then {d['preset']} ({d['layout']}), {d['n_micro']} micro-batches of {d['micro_batch_size']} per rank, "
            f"4 ranks on the 2 cores, {d['rounds']} launches per variant alternating, medians: the exposed all-to-all "
            "time per step (a rank's seconds inside its all-to-alls, mean over ranks) of 1F1B, of DualPipeV's table run "
            "one action after the other (off) and with its F & B pairs interleaved (on). `sleep`: attention and "
            "experts emulated by sleeps (the cores a rank would have to itself); routing and all-to-alls real.", "",
            _img("dualpipe_ep", "DualPipeV's overlap: exposed all-to-all and step time"), "",
            "| compute | transport | 1f1b ms | dualpipev off ms | dualpipev on ms | hidden vs 1f1b | hidden vs off | "
            "step on / 1f1b | step on / off |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        e = [1e3 * v["exposed_a2a_s"] for v in r["variants"]]
        out.append(f"| {r['work']} | {r['transport']} | {e[0]:.1f} | {e[1]:.1f} | {e[2]:.1f} | {r['hidden_vs_1f1b']:.2f} | "
                   f"{r['hidden_vs_sequential']:.2f} | {r['step_on_over_1f1b']:.2f} | {r['step_on_over_off']:.2f} |")
    return "\n".join(out) + "\n"


def sec_call_overhead(res, status) -> str:
    d, out = _opening(res, status, "call_overhead", "## Per-call cost: MPIComm against the library called through mpi4py")
    if not d:
        return "\n".join(out)
    out += ["`python bench/call_overhead.py`: `MPIComm(world).allreduce(x, out=y)` (algo auto; `abort` = the default "
            "communicator, `raise` = `on_timeout=\"raise\"`) against `world.Dup().Allreduce(x, y)` (`library`), "
            "float32 out of place; the best round of back-to-back calls per row, rounds alternating, the slowest "
            "rank's mean per call. ratio = time / library's (< 1: faster than calling the library directly; target "
            f"<= {d.get('target', 1.15)} at 8 B and 4 KiB). Ranks beyond 2 oversubscribe the 2 cores.", "",
            _img("call_overhead", "per-call cost against mpi4py"), "",
            "| transport | ranks | size | library us | abort us (chosen) | abort / library | raise us (chosen) | raise / library |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        u, c, q = r["us"], r["chosen"], r["ratio"]
        out.append(f"| {r['transport']} | {r['nranks']} | {human(r['bytes'])} | {u['library']:.2f} | {u['abort']:.2f} "
                   f"({c['abort']}) | {q['abort']:.2f} | {u['raise']:.2f} ({c['raise']}) | {q['raise']:.2f} |")
    return "\n".join(out) + "\n"


def sec_memory(res, status) -> str:
    d, out = _opening(res, status, "memory", "## Memory per rank: ZeRO, recomputation, dp/tp/pp, against the ledger and the planner")
    if not d:
        return "\n".join(out)
    G = 2 ** 30
    out += ["`python bench/memory.py`: one real run per row (2 steps, micro-batch 1, float32, AdamW), every rank "
            "under `/usr/bin/time -f %M`: **measured** is the largest peak resident memory (VmHWM) over the ranks, "
            "read from outside. **ledger** is rank 0's own account (summary.json: parameters + gradients + optimizer "
            "state + activations + communication buffers + workspace) and **predicted** the planner's figure for the "
            "worst rank (`pympar.parallel.ledger.predict`, what `python -m pympar.plan` uses) plus the process "
            f"baseline, {d['baseline_bytes'] / 2**20:.0f} MiB (one rank of the trainer with a model of a few KB, measured "
            "the same way). Step time: the second step, for comparing rows of one world size only (ranks "
            "oversubscribe the 2 cores). Rows the planner predicted not to fit in 21 GiB for all ranks were not run.", "",
            _img("memory", "memory per rank"), "",
            "| model | ranks | layout | ZeRO | recompute | measured GiB | ledger GiB (rank 0) | predicted GiB | predicted / measured | model state GiB (rank 0) | step s |",
            "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        head = f"| {r['model']} | {r['world']} | {r['layout']} | {r['zero']} | {r['recompute']} |"
        if "measured_peak" not in r:
            out.append(head + f" not run: {r['skipped']} | | {r['predicted_peak'] / G:.2f} | | | |")
            continue
        led = r["ledger_rank0"]
        out.append(head + f" {r['measured_peak'] / G:.2f} | {(led['peak'] + d['baseline_bytes']) / G:.2f} | "
                   f"{r['predicted_peak'] / G:.2f} | {r['ratio_predicted_to_measured']:.2f} | "
                   f"{r['model_state_rank0'] / G:.2f} | {r['step_time_s']:.1f} |")
    out += ["", "Figures the issue sets (from the rows above):", ""]
    for k, v in d["targets"].items():
        out.append(f"- {k}: " + (f"{v['within_10pct']} of {v['of']} rows within 10%, range {v['min']:.2f}-{v['max']:.2f}"
                                 if isinstance(v, dict) else f"{v:.3f}"))
    return "\n".join(out) + "\n"


# the bench script that writes each JSON (for the targets table's command column)
COMMANDS = {"checkpoint": "python bench/checkpoint.py", "dualpipe_ep": "python bench/dualpipe_ep.py", "context_parallel": "python bench/context_parallel.py",
            "memory": "python bench/memory.py",
            "attention": "python bench/attention.py", "auto_select": "python bench/auto_select.py",
            "call_overhead": "python bench/call_overhead.py", "moe_experts": "python bench/moe_experts.py",
            "moe_dispatch": "python bench/moe_dispatch.py", "moe_replicas": "python bench/moe_replicas.py",
            "train_step": "python bench/train_step.py --dtype bfloat16"}
_BOUND = re.compile(r"\(?target (<=|>=) ([\d.]+)[^)]*\)?")


def _without_target(key: str) -> str:
    """'x / y (peak RSS, target <= 0.4)' -> 'x / y (peak RSS)'; 'x (target <= 1.05; notes)' -> 'x'."""
    def inner(m):
        kept = re.sub(r",?\s*target (<=|>=) [\d.]+.*$", "", m.group(1)).strip(" ,;")
        return f"({kept})" if kept else ""
    return re.sub(r"\(([^()]*target (?:<=|>=)[^()]*)\)", inner, key).strip()


def _verdict(value: float, op: str, bound: float) -> str:
    ok = value <= bound if op == "<=" else value >= bound
    if ok:
        return "met"
    return f"**missed** by {value / bound:.2f}x" if op == "<=" else f"**missed**: {value / bound:.2f} of it"


def target_rows(res: Path) -> list:
    """(what, target, figure, command, verdict) for every target a benchmark JSON records: the
    ``targets`` dicts (keys carrying '(target <= X)' or '(target >= X)'), the attention peak's growth,
    auto's points within its factor, and issue 43's bf16 step figures."""
    rows = []
    for name in sorted(COMMANDS):
        d = _load(res, name)
        if not d:
            continue
        cmd = COMMANDS[name]
        for key, v in (d.get("targets") or {}).items():
            m = _BOUND.search(key)
            if m is None or not isinstance(v, (int, float)):
                continue
            what = _without_target(key)
            op, bound = m.group(1), float(m.group(2))
            verdict = _verdict(v, op, bound)
            if "model state / ideal" in key:       # the ledger's own account of itself: no evidence
                verdict = "not a measurement (the ledger's own account; tests/mpi/mpi_memory.py measures it)"
            rows.append((what, f"{op} {bound:g}", f"{v:.3f}", f"`{cmd}` ({name}.json)", verdict))
        if name == "attention" and "tiled_peak_growth" in d:
            g = d["tiled_peak_growth"]
            rows.append((f"attention: tiled peak at T {g['to_T']} / at T {g['from_T']} (VmHWM)", f"<= {g['target']:g}",
                         f"{g['ratio']:.2f}", f"`{cmd}`", _verdict(g["ratio"], "<=", g["target"])))
        if name == "auto_select" and d.get("summary"):
            tgt, summ = d.get("target", 1.15), d["summary"]
            ok = sum(1 for x in summ if x["auto_over_best"] <= tgt)
            worst = max(x["auto_over_best"] for x in summ)
            rows.append((f'algo="auto" within {tgt}x of the best choice at every (size, ranks, transport) point',
                         f"{len(summ)} of {len(summ)}", f"{ok} of {len(summ)} (worst {worst:.2f}x)", f"`{cmd}`",
                         "met" if ok == len(summ) else f"**missed** at {len(summ) - ok} points"))
        if name == "call_overhead" and d.get("rows"):
            tgt = d.get("target", 1.15)
            for mode, label in (("abort", "MPIComm(world)"), ("raise", 'MPIComm(world, on_timeout="raise")')):
                pts = [r for r in d["rows"] if r["bytes"] in (8, 4096)]
                vals = [r["ratio"][mode] for r in pts]
                ok = sum(v <= tgt for v in vals)
                rows.append((f"{label}.allreduce per call / mpi4py's Allreduce at 8 B and 4 KiB (every transport, ranks)",
                             f"<= {tgt:g} at {len(vals)} of {len(vals)}", f"{min(vals):.2f}-{max(vals):.2f}; {ok} of {len(vals)}",
                             f"`{cmd}`", "met" if ok == len(vals) else f"**missed** at {len(vals) - ok} points "
                             f"(worst {max(vals):.2f}x)"))
        if name == "train_step":
            bf = {k: r for k, r in d.get("table", {}).items() if k.endswith("/bf16")}
            for label, key, op, bound, shapes in (
                    ("bf16 step over PyTorch autocast eager + SDPA", "sdpa_speed_ratio", ">=", 1.25, None),
                    ("bf16 step over autocast + torch.compile", "compile_speed_ratio", ">=", 1.1, None),
                    ("bf16 model FLOP/s over the bf16 GEMM rate (two larger shapes)", "pympar_mfu_vs_bf16_gemm", ">=",
                     0.6, ("L6", "L12"))):
                vals = [r[key] for k, r in bf.items() if key in r and (shapes is None or k.startswith(shapes))]
                if vals:
                    rows.append((label, f"{op} {bound:g}", f"{min(vals):.2f}-{max(vals):.2f} ({len(vals)} rows)",
                                 f"`{cmd}`", _verdict(min(vals), op, bound)))
    return rows


def sec_targets(res, status) -> str:
    rows = target_rows(res)
    out = ["## Targets the project set itself", "",
           "Every target recorded in the JSON below, its latest figure, the command that measured it, and met or "
           "missed (by how much). A target missed stays here until it is met.", "",
           "| what | target | figure | command | verdict |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows] or ["| (no results yet) | | | | |"]
    return "\n".join(out) + "\n"


def render(res: Path, status: dict) -> str:
    from common import machine

    head = ["# Benchmarks", "",
            "Generated by `python bench/run_all.py` from the JSON in bench/results/ (figures in docs/img/). "
            f"Each section's JSON names the machine it ran on (sessions land on different CPUs); this page was "
            f"last generated on: {machine()}. Every rank count above 2 oversubscribes the cores, and the VM is shared with "
            "other jobs: absolute times are noise. Each comparison is measured side by side inside one step of the "
            "run, so read the ratios; different sections ran at different times under different load.", ""]
    quick = [n for n, s in status.items() if s.get("quick")]
    if quick:
        head += [f"**These results include --quick smoke runs ({', '.join(quick)}): small sizes and few steps.**", ""]
    secs = [sec_targets, sec_collectives, sec_auto_select, sec_call_overhead, sec_train_step, sec_gemm, sec_attention, sec_ddp_step, sec_kernels, sec_strategies, sec_pipeline, sec_pipeline_head, sec_dp, sec_moe, sec_moe_experts, sec_moe_dispatch, sec_moe_replicas, sec_moe_fold,
            sec_compression, sec_plan, sec_memory, sec_reproducible, sec_param_server, sec_cp_comm, sec_cp_hybrid, sec_dualpipe_ep, sec_soak]
    return "\n".join(head) + "\n" + "\n".join(s(res, status) for s in secs)
