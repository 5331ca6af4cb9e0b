"""Peak resident memory per rank, measured from outside, beside the ledger and the planner.

    python bench/memory.py                 # the matrix below (about half an hour on 2 cores)
    python bench/memory.py --quick         # a 2-layer model, 1 and 2 ranks (seconds; the smoke test)

Every row is one real run of ``python -m pympar.train`` under mpiexec, each rank wrapped in
``/usr/bin/time -f %M`` (VmHWM as the kernel counts it, read after the rank exits): the table
shows the largest peak over the ranks. Beside it: the ledger the run measured on its rank 0
(summary.json: parameters, gradients, optimizer state, activations, communication buffers,
workspace) and the planner's prediction for the worst rank (pympar.parallel.ledger.predict, the
function ``python -m pympar.plan`` uses), plus the process baseline (one rank of the trainer with
a model of a few KB: measured here the same way). predicted / measured is the planner's accuracy.

Models: gpt2-small's shape (12 layers, 768 wide, vocab 50304, block 1024: 124M parameters) and
a 51M one (8 layers, 512 wide, same vocab and block), micro-batch 1, float32, AdamW; layouts:
dp, tp and pp at 1, 2, 4 and 8 ranks, ZeRO 0-3, recomputation none and full. A configuration the
planner predicts to need more than the machine's memory for all its ranks is not run (the row
says so). Step times are the second step's (the first pays for warm-up), a cost to compare
within one world size only: ranks oversubscribe the 2 cores.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, pyplot, run_and_write, run_with_peaks, save  # noqa: E402

from pympar.nn.config import GPTConfig  # noqa: E402
from pympar.nn.gpt import count_params  # noqa: E402
from pympar.parallel import ledger  # noqa: E402

GiB = 2 ** 30
MODELS = {
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, block_size=1024),
    "m51": dict(n_layer=8, n_embd=512, n_head=8, vocab_size=50304, block_size=1024),
    "quick": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512, block_size=64),
}
BUDGET = 21 * GiB                        # what all ranks of one run may take together on this VM


def matrix(quick: bool):
    """(model, world, layout flags, zero, recompute) rows."""
    if quick:
        return [("quick", 1, "--dp 1", 0, "none"), ("quick", 2, "--dp 2", 3, "full"), ("quick", 2, "--dp 2", 1, "none")]
    rows = []
    for model in ("gpt2-small", "m51"):
        rows += [(model, 1, "--dp 1", 0, rc) for rc in ("none", "selective", "full")]
        for n in (2, 4, 8):
            for z in (0, 1, 2, 3):
                for rc in ("none", "full"):
                    if model == "m51" and (n == 2 or rc == "full" and z in (1, 2)):
                        continue                                 # the smaller model: a sparser grid
                    rows.append((model, n, f"--dp {n}", z, rc))
            if n in (2, 4):
                rows += [(model, n, f"--tp {n}", 0, "none"), (model, n, f"--pp {n}", 0, "none")]
        rows += [(model, 4, "--dp 2 --tp 2", 3, "full"), (model, 8, "--dp 2 --pp 2 --tp 2", 3, "full")]
    return rows


def _flags(layout: str) -> dict:
    t = layout.split()
    return {k.lstrip("-"): int(v) for k, v in zip(t[::2], t[1::2])}


def baseline() -> int:
    """Peak RSS of one rank of the trainer itself with a model of a few KB (1 layer, 8 wide, 2
    steps): the interpreter, the libraries, MPI and the trainer's own overhead."""
    with tempfile.TemporaryDirectory() as out:
        _, peaks = run_with_peaks(1, ["-m", "pympar.train", "--preset", "tiny", "--n-layer", 1, "--n-embd", 8,
                                "--n-head", 1, "--block-size", 8, "--micro-batch-size", 1, "--dtype", "float32", "--steps", 2,
                                "--eval-every", 0, "--sample-tokens", 0, "--progress", "log", "--out", out], 120)
    return max(peaks.values())


def run(a):
    base = baseline()
    rows = []
    worlds = {int(w) for w in a.worlds.split(",") if w}
    for model, n, layout, zero, rc in matrix(a.quick):
        if worlds and n not in worlds:
            continue
        cfg = GPTConfig(**MODELS[model]).validate()
        f = _flags(layout)
        dp, pp, tp = f.get("dp", 1), f.get("pp", 1), f.get("tp", 1)
        if dp * pp * tp != n:
            dp = n // (pp * tp)
        n_micro = pp if pp > 1 else 1
        pred, worst = ledger.predict(cfg, dp=dp, pp=pp, tp=tp, zero=zero, recompute=rc, micro_batch_size=1,
                                     n_micro=n_micro)
        row = dict(model=model, world=n, layout=f"dp{dp} pp{pp} tp{tp}", zero=zero, recompute=rc,
                   predicted_peak=pred["peak"] + base, predicted=pred, predicted_worst_pp_rank=worst, baseline=base)
        label = f"{model:10s} {n} ranks {row['layout']:12s} zero {zero} recompute {rc:5s}"
        if (pred["peak"] + base) * n > BUDGET:
            row["skipped"] = f"predicted {(pred['peak'] + base) / GiB:.2f} GiB x {n} ranks > {BUDGET / GiB:.0f} GiB"
            print(f"{label}: skipped ({row['skipped']})", flush=True)
            rows.append(row)
            continue
        with tempfile.TemporaryDirectory() as out:
            args = ["-m", "pympar.train", "--preset", "tiny", *[x for k, v in MODELS[model].items()
                                                              for x in (f"--{k.replace('_', '-')}", v)],
                    "--dp", dp, "--pp", pp, "--tp", tp, "--zero", zero, "--recompute", rc, "--micro-batch-size", 1,
                    "--n-micro", n_micro, "--dtype", "float32",    # the matrix is float32 (the default is auto)
                    "--steps", 2, "--warmup", 1, "--eval-every", 0, "--sample-tokens", 0,
                    "--progress", "log", "--out", out]
            p, peaks = run_with_peaks(n, args, a.timeout)
            if p.returncode != 0 or len(peaks) != n:
                raise RuntimeError(f"{label} failed ({p.returncode}, {len(peaks)} of {n} peaks):\n"
                                   f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
            summ = json.loads((Path(out) / "summary.json").read_text())
            steps = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        row.update(measured_peak=max(peaks.values()), measured_rank=max(peaks, key=peaks.get),
                   measured_per_rank=[peaks[r] for r in sorted(peaks)], ledger_rank0=summ["memory"]["ledger_rank0"],
                   ledger_peak_max=summ["memory"]["ledger_peak_max_bytes"],
                   inside_peak_rss_max=summ["memory"]["peak_rss_max_bytes"], step_time_s=steps[-1]["step_time"])
        row["ratio_predicted_to_measured"] = row["predicted_peak"] / row["measured_peak"]
        led = row["ledger_rank0"]
        # what persists: the transient full gradients of ZeRO-2/3 (buckets being filled) aside
        row["model_state_rank0"] = led["parameters"] + led["gradients"] - led.get("gradients_transient", 0) + led["optimizer"]
        row["transient_grads_rank0"] = led.get("gradients_transient", 0)
        print(f"{label}: measured {row['measured_peak'] / GiB:6.2f} GiB (rank {row['measured_rank']}), predicted "
              f"{row['predicted_peak'] / GiB:6.2f} ({row['ratio_predicted_to_measured']:.2f}x), step "
              f"{row['step_time_s']:.1f} s", flush=True)
        rows.append(row)
    return dict(machine=machine(), baseline_bytes=base, rows=rows, targets=targets(rows))


def targets(rows) -> dict:
    """The issue's figures, from the rows that ran."""
    ran = [r for r in rows if "measured_peak" in r]
    out = {}
    acc = [r["ratio_predicted_to_measured"] for r in ran]
    if acc:
        out["predicted_over_measured"] = dict(min=min(acc), max=max(acc),
                                              within_10pct=sum(abs(x - 1) <= 0.10 for x in acc), of=len(acc))
    for model in {r["model"] for r in ran}:
        one = [r for r in ran if r["model"] == model and r["world"] == 1 and r["recompute"] == "none"]
        z3 = [r for r in ran if r["model"] == model and r["world"] == 4 and r["layout"] == "dp4 pp1 tp1"
              and r["zero"] == 3 and r["recompute"] == "full"]
        if one and z3:
            out[f"{model}: dp4 zero3+full / dp1 (peak RSS, target <= 0.4)"] = z3[0]["measured_peak"] / one[0]["measured_peak"]
        none = [r for r in ran if r["model"] == model and r["world"] == 1 and r["recompute"] == "none"]
        full = [r for r in ran if r["model"] == model and r["world"] == 1 and r["recompute"] == "full"]
        if none and full:
            out[f"{model}: activations none / full (ledger, target >= 4)"] = \
                none[0]["ledger_rank0"]["activations"] / max(1, full[0]["ledger_rank0"]["activations"])
        P = count_params(GPTConfig(**MODELS[model]).validate()) * 4          # bytes of float32 parameters
        ideal = {0: 4 * P, 1: 2 * P + 2 * P / 4, 2: P + 3 * P / 4, 3: 4 * P / 4}
        for z in (0, 1, 2, 3):
            r = [x for x in ran if x["model"] == model and x["world"] == 4 and x["layout"] == "dp4 pp1 tp1"
                 and x["zero"] == z and x["recompute"] == "none"]
            if r:
                out[f"{model}: dp4 zero{z} model state / ideal (target <= 1.05; transients apart: "
                    f"{r[0]['transient_grads_rank0'] / 2**20:.0f} MiB)"] = r[0]["model_state_rank0"] / ideal[z]
    return out


def plot(res, path):
    ran = [r for r in res["rows"] if "measured_peak" in r and r["model"] == "gpt2-small"] or \
        [r for r in res["rows"] if "measured_peak" in r]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    xs = range(len(ran))
    ax.bar([x - 0.2 for x in xs], [r["measured_peak"] / GiB for r in ran], 0.4, label="measured peak RSS (max over ranks)")
    ax.bar([x + 0.2 for x in xs], [r["predicted_peak"] / GiB for r in ran], 0.4, label="planner's prediction")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['world']}: {r['layout'].replace(' pp1', '').replace(' tp1', '')}\nz{r['zero']} "
                        f"{dict(full='rc', selective='sel').get(r['recompute'], '')}" for r in ran], fontsize=6)
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{ran[0]['model'] if ran else ''}: peak memory per rank, ZeRO stage z, rc = full recomputation")
    ax.legend()
    save(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model on 1 and 2 ranks (the smoke test)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--worlds", default="", help="comma-separated world sizes: only the matrix's rows of these "
                                                  "(e.g. 1; write them to another --json to keep the full run's)")
    res = run_and_write(ap, argv, "memory", run, plot)
    for k, v in res["targets"].items():
        print(f"{k}: {v if isinstance(v, dict) else round(v, 3)}")
    return res


if __name__ == "__main__":
    main()
