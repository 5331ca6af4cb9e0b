"""Soak: many training steps on 8 ranks with periodic checkpoints; the resident memory of
every rank must not grow after warm-up (issue 7).

Runs ``python -m pympar.train`` with ``--save-every`` (and ``--keep``, so old checkpoints are
pruned) and reads rss_bytes (rank 0) and rss_max_bytes (the largest RSS of any rank, VmRSS
of /proc/self/status) and the same for RssAnon (heap and anonymous maps: VmRSS less the file
pages, which include the memory-mapped corpus: they grow as training samples more of the
file and the kernel may drop them at any time, so they are no leak). Growth = median over
the last tenth of the steps / median over the steps just after warm-up (the second tenth)
- 1. It fails (exit status 1) when the anonymous memory of the largest rank grows by more
than --max-growth (default 5%); the VmRSS growth is reported beside it.

    python bench/soak.py --world 8 --steps 400 --save-every 25 --json bench/results/soak.json --png docs/img/soak.png

Not part of CI: a few minutes on this machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def growth(values: list) -> tuple:
    """(baseline, end, end / baseline - 1): medians of the second and of the last tenth."""
    n = len(values)
    k = max(1, n // 10)
    base = statistics.median(values[k:2 * k] or values[:1])
    end = statistics.median(values[-k:])
    return base, end, end / base - 1.0


def run(a) -> dict:
    with tempfile.TemporaryDirectory() as out:
        args = ["--preset", a.preset, "--steps", a.steps, "--save-every", a.save_every, "--keep", 2,
                "--micro-batch-size", a.micro_batch_size, "--eval-every", a.eval_every]
        m = common.train(a.world, args + a.extra.split(), a.timeout, out=out)
        ckpts = sorted(p.name for p in (Path(out) / "checkpoints").iterdir()) if (Path(out) / "checkpoints").exists() else []
    r0 = [r["rss_bytes"] for r in m]
    rmax = [r["rss_max_bytes"] for r in m]
    amax = [r["rss_anon_max_bytes"] for r in m]
    _, _, g0 = growth(r0)
    bm, em, gm = growth(rmax)
    ba, ea, ga = growth(amax)
    res = dict(kind="soak", machine=common.machine(), world=a.world, preset=a.preset, steps=a.steps,
               save_every=a.save_every, checkpoints_kept=ckpts, rss_rank0=r0, rss_max=rmax, anon_max=amax,
               growth_rank0=g0, growth_max=gm, baseline_max=bm, end_max=em, growth_anon=ga, baseline_anon=ba,
               end_anon=ea, max_growth=a.max_growth, passed=ga <= a.max_growth, loss_first=m[0]["loss"],
               loss_last=m[-1]["loss"], step_time_median=statistics.median(r["step_time"] for r in m))
    print(f"soak: {a.world} ranks, {a.steps} steps, checkpoint every {a.save_every}: largest rank anonymous "
          f"{ba / 2**20:.1f} -> {ea / 2**20:.1f} MiB ({100 * ga:+.2f}%), VmRSS {bm / 2**20:.1f} -> "
          f"{em / 2**20:.1f} MiB ({100 * gm:+.2f}%, rank 0 {100 * g0:+.2f}%); "
          f"{'PASS' if res['passed'] else 'FAIL'} (limit {100 * a.max_growth:.0f}%)", flush=True)
    return res


def plot(res: dict, png) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3))
    steps = range(1, len(res["rss_max"]) + 1)
    ax.plot(steps, [v / 2**20 for v in res["rss_max"]], label="largest RSS of any rank")
    ax.plot(steps, [v / 2**20 for v in res["rss_rank0"]], label="rank 0", lw=0.8)
    ax.plot(steps, [v / 2**20 for v in res["anon_max"]], label="largest anonymous (RssAnon) of any rank")
    for s in range(res["save_every"], res["steps"] + 1, res["save_every"]):
        ax.axvline(s, color="gray", lw=0.3)
    ax.set(xlabel="step (grey: checkpoint)", ylabel="resident memory (MiB)",
           title=f"soak, {res['world']} ranks {res['preset']}, end / after warm-up: anonymous "
                 f"{1 + res['growth_anon']:.3f}x, VmRSS {1 + res['growth_max']:.3f}x (largest rank)")
    ax.legend(fontsize=7)
    fig.suptitle(common.machine(), fontsize=7)
    common.save(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--extra", default="", help="more trainer flags, e.g. '--dp 4 --pp 2'")
    ap.add_argument("--max-growth", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=1800)
    res = common.run_and_write(ap, argv, "soak", run, plot)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
