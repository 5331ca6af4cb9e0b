"""The step stall of a checkpoint, synchronous and --async-save, for the gpt2-124m preset.

    python bench/checkpoint.py              # gpt2-124m, 1 rank, micro-batch 1 (a few minutes on 2 cores)
    python bench/checkpoint.py --quick      # the tiny preset (seconds; the smoke test)

Each run is ``python -m pympar.train`` with --save-every 1 for STEPS steps into a fresh --out;
metrics.jsonl records, per saving step, ``save_s``: the seconds the step waited for its save
(synchronous: the whole save, files written and published; --async-save: the collective setup and
the copy of the state to host memory, the file written by a thread while the next step runs).
Medians over the saving steps after the first; the step time without a save beside them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch, machine, pyplot, run_and_write, save  # noqa: E402

STEPS = 5


def one(preset, async_save, timeout):
    with tempfile.TemporaryDirectory() as d:
        args = ["-m", "pympar.train", "--preset", preset, "--micro-batch-size", 1, "--steps", STEPS, "--save-every", 1,
                "--keep", 2, "--eval-every", 0, "--sample-tokens", 0, "--progress", "log", "--out", d]
        if async_save:
            args.append("--async-save")
        p = launch(1, args, timeout)
        if p.returncode:
            raise RuntimeError(f"{preset} async={async_save} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        size = sum(f.stat().st_size for f in (Path(d) / "checkpoints").rglob("*") if f.is_file()) / 2
    saves = [r["save_s"] for r in rows if "save_s" in r][1:]
    return dict(async_save=async_save, save_s=statistics.median(saves), save_s_all=[r.get("save_s") for r in rows],
                step_s=statistics.median(r["step_time"] for r in rows[1:]), checkpoint_bytes=int(size))


def run(a):
    preset = "tiny" if a.quick else "gpt2-124m"
    rows = [one(preset, False, a.timeout), one(preset, True, a.timeout)]
    sync, asyn = rows
    for r in rows:
        print(f"{preset} {'async' if r['async_save'] else 'sync '}: the step waits {r['save_s']:.3f} s for its save "
              f"(step {r['step_s']:.2f} s, checkpoint {r['checkpoint_bytes'] / 2**20:.0f} MiB)", flush=True)
    ratio = asyn["save_s"] / sync["save_s"]
    return dict(machine=machine(), preset=preset, steps=STEPS, rows=rows,
                targets={"async stall / synchronous save time (target <= 0.2)": ratio})


def plot(res, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    labels = ["synchronous", "--async-save"]
    ax.bar(labels, [r["save_s"] for r in res["rows"]], color=["tab:red", "tab:green"])
    ax.set_ylabel("seconds the step waits")
    ax.set_title(f"{res['preset']}: checkpoint stall per save", fontsize=9)
    save(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny preset (the smoke test)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    res = run_and_write(ap, argv, "checkpoint", run, plot)
    for k, v in res["targets"].items():
        print(f"{k}: {v:.3f}")
    return res


if __name__ == "__main__":
    main()
