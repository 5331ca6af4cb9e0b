"""Experts folded apart from tensor parallelism: peak memory per rank and step time of one
attention layout (tp 2 x dp 4 on 8 ranks) with the experts on four grids.

    python bench/moe_fold.py              # 8 ranks, the four expert grids below + the single process
    python bench/moe_fold.py --quick      # 4 ranks (tp 2 x dp 2), a smaller model (the smoke test)

Every row is one real ``python -m pympar.train`` under mpiexec, each rank wrapped in
``/usr/bin/time -f %M`` (VmHWM, read after the rank exits: bench/common.run_with_peaks). The model
is MoE in every block (C 384, 16 experts, top-2, dropless, float32, AdamW), so the experts hold
most of the parameters. Expert grids over the same 8 ranks:

    ep 1           each expert split over tp 2, all experts on every dp rank (replicated over dp 4)
    ep 4           unfolded: ep over the dp ranks (its largest value there), experts split over tp
    ep 4, etp 1    folded: whole experts, ep over dp and tp ranks, each expert on 2 ranks (edp 2)
    ep 8, etp 1    folded: whole experts, each on exactly one rank (the issue's example)

plus one process on the same global batch (micro-batch 2 x 4 micro-batches). Per row: the
largest and smallest peak over the ranks, the expert parameter elements a rank holds (arithmetic:
n_expert/ep experts of 1/etp width each), the step time (median over the steps after the first;
8 ranks share 2 cores, so compare rows with each other only) and every step's loss against the
single process's (float32: equal to ~1e-6 relative; the test suite checks the same layouts).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, pyplot, run_and_write, run_with_peaks, save  # noqa: E402

GiB = 2 ** 30


def model_args(quick: bool) -> list:
    C, E = (128, 8) if quick else (384, 16)
    return ["--preset", "moe-tiny", "--n-layer", 2, "--n-embd", C, "--n-head", 4, "--n-expert", E,
            "--moe-every", 1, "--top-k", 2, "--capacity-factor", 0.0, "--block-size", 128]


def grids(quick: bool):
    """(label, world, layout flags, ep, etp) rows; dp ranks x n_micro = 4 micro-batches of 2."""
    if quick:
        return [("ep 1", 4, "--tp 2 --dp 2 --ep 1", 1, 2), ("ep 2", 4, "--tp 2 --dp 2 --ep 2", 2, 2),
                ("ep 4, etp 1 (folded)", 4, "--tp 2 --dp 2 --ep 4 --etp 1", 4, 1)]
    return [("ep 1", 8, "--tp 2 --dp 4 --ep 1", 1, 2), ("ep 4", 8, "--tp 2 --dp 4 --ep 4", 4, 2),
            ("ep 4, etp 1 (folded)", 8, "--tp 2 --dp 4 --ep 4 --etp 1", 4, 1),
            ("ep 8, etp 1 (folded)", 8, "--tp 2 --dp 4 --ep 8 --etp 1", 8, 1)]


def train(n, args, steps, timeout):
    """(metrics records, {rank: peak bytes}) of one run."""
    with tempfile.TemporaryDirectory() as out:
        full = ["-m", "pympar.train", *args, "--micro-batch-size", 2, "--steps", steps, "--warmup", 1, "--lr", 1e-3,
                "--dtype", "float32", "--eval-every", 0, "--sample-tokens", 0, "--progress", "log", "--out", out]
        p, peaks = run_with_peaks(n, full, timeout)
        if p.returncode != 0 or len(peaks) != n:
            raise RuntimeError(f"pympar.train -n {n} {' '.join(map(str, args))} failed ({p.returncode}):\n"
                               f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        recs = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return recs, peaks


def run(a):
    m = model_args(a.quick)
    C, E = int(m[m.index("--n-embd") + 1]), int(m[m.index("--n-expert") + 1])
    ref, ref_peaks = train(1, [*m, "--dp", 1, "--n-micro", 4], a.steps, a.timeout)
    ref_loss = [r["loss"] for r in ref]
    print(f"single process: peak {max(ref_peaks.values()) / GiB:.2f} GiB, losses {[round(x, 5) for x in ref_loss]}",
          flush=True)
    rows = []
    for label, n, flags, ep, etp in grids(a.quick):
        dp = int(flags.split("--dp ")[1].split()[0])
        recs, peaks = train(n, [*m, *flags.split(), "--n-micro", 4 // dp], a.steps, a.timeout)
        loss = [r["loss"] for r in recs]
        rel = max(abs(x - y) / abs(y) for x, y in zip(loss, ref_loss))
        per_expert = 2 * 4 * C * C // etp + 4 * C // etp + C          # c_fc, c_proj (and their biases)
        rows.append(dict(label=label, world=n, flags=flags, ep=ep, etp=etp,
                         expert_params_per_rank=2 * (E // ep) * per_expert,   # 2 MoE layers
                         peak_max=max(peaks.values()), peak_min=min(peaks.values()),
                         peaks=[peaks[r] for r in sorted(peaks)],
                         step_s=statistics.median(r["step_time"] for r in recs[1:]),
                         losses=loss, max_rel_loss_diff=rel))
        r = rows[-1]
        print(f"{label:22s} {flags:32s} peak {r['peak_max'] / GiB:.3f} GiB (min {r['peak_min'] / GiB:.3f}), "
              f"expert params/rank {r['expert_params_per_rank'] / 1e6:.2f} M, step {r['step_s'] * 1e3:.0f} ms, "
              f"loss vs 1 process {rel:.1e}", flush=True)
    base = rows[0]
    for r in rows:
        r["peak_vs_ep1"] = r["peak_max"] / base["peak_max"]
        r["step_vs_ep1"] = r["step_s"] / base["step_s"]
    return dict(machine=machine(), quick=a.quick, steps=a.steps, model=[str(x) for x in m],
                single_process=dict(losses=ref_loss, peak=max(ref_peaks.values())), rows=rows)


def plot(res, path):
    plt = pyplot()
    rows = res["rows"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(8, 3))
    x = range(len(rows))
    labels = [r["label"].replace(" (folded)", "\n(folded)") for r in rows]
    ax.bar(x, [r["peak_max"] / GiB for r in rows], color="tab:blue", label="largest rank")
    ax.bar(x, [r["peak_min"] / GiB for r in rows], color="tab:cyan", width=0.4, label="smallest rank")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("peak resident memory per rank (GiB, VmHWM)")
    ax.set_title(f"tp 2 x dp {rows[0]['world'] // 2} for attention, {rows[0]['world']} ranks")
    ax.legend(fontsize=7)
    bx.bar(x, [r["step_s"] * 1e3 for r in rows], color="tab:orange")
    bx.set_xticks(list(x), labels)
    bx.set_ylabel("step time (ms, median; ranks share 2 cores)")
    bx.set_title("same losses as one process in every row")
    save(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=900)
    return run_and_write(ap, argv, "moe_fold", run, plot)


if __name__ == "__main__":
    main()
