"""Collectives side by side: every pympar algorithm against the MPI library's own call
(mpi4py, row "library") and torch.distributed gloo (allreduce), 2 to 8 ranks, 8 B to 256 MiB.

Each (collective, rank count) is one ``python -m pympar.bench <coll> --algo all --json``
run (nccl-tests columns: busbw = size/time x 2(n-1)/n for allreduce, (n-1)/n for
reduce_scatter, allgather, alltoall, 1 for broadcast); small sizes get more iterations
than the large ones, which run few (a 256 MiB allreduce on 8 oversubscribed ranks takes
seconds). Allreduce is compared in place (the only placement gloo has), the others out of
place. Ratios are against the library's own call at the same size and rank count.

    python bench/collectives.py --ranks 2,4,8 --json bench/results/collectives.json --png-dir docs/img
    python bench/collectives.py --ranks 2,4 --max 1M --collectives allreduce \
        --json bench/results/quick/collectives.json --png-dir bench/results/quick     # a quick look
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

LARGE = 4 << 20          # sizes from here on run with --large-iters


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


def bench(coll: str, n: int, lo: int, hi: int, factor: int, iters: int, warmup: int, check: int, timeout: float) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        p = common.launch(n, ["-m", "pympar.bench", coll, "-b", str(lo), "-e", str(hi), "-f", str(factor),
                              "-n", str(iters), "-w", str(warmup), "-c", str(check), "--algo", "all",
                              "--json", str(out)], timeout)
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"pympar.bench {coll} -n {n} failed ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
        return json.loads(out.read_text())["rows"]


def run(a) -> dict:
    results = []
    hi_all = parse_size(a.max)
    for coll in a.collectives.split(","):
        hi = hi_all if coll == "allreduce" else min(hi_all, parse_size(a.max_other))
        for n in [int(x) for x in a.ranks.split(",")]:
            rows = []
            small_hi = min(hi, LARGE // a.factor)
            rows += bench(coll, n, 8, small_hi, a.factor, a.iters, a.warmup, 1, a.timeout)
            if hi >= LARGE:
                rows += bench(coll, n, LARGE, hi, a.factor, a.large_iters, 1, 0, a.timeout)
            for r in rows:
                r.update(collective=coll, nranks=n)
            results += rows
            wrong = sum(r["wrong"] for r in rows if r["wrong"] > 0)
            print(f"  {coll} n={n}: {len(rows)} rows, sizes {rows[0]['bytes']}..{rows[-1]['bytes']} B, wrong {wrong}",
                  file=sys.stderr, flush=True)
    return dict(kind="collectives", machine=common.machine(), rows=results, summary=summarize(results))


def placement(coll: str) -> str:
    return "in" if coll == "allreduce" else "out"


def summarize(rows: list) -> list:
    """Per (collective, n, size): library time, best pympar algorithm, its time ratio, gloo's."""
    out = []
    keys = sorted({(r["collective"], r["nranks"], r["bytes"]) for r in rows})
    for coll, n, size in keys:
        rs = [r for r in rows if (r["collective"], r["nranks"], r["bytes"]) == (coll, n, size)
              and r["placement"] == placement(coll)]
        lib = next((r for r in rs if r["algo"] == "library"), None)
        ours = [r for r in rs if r["algo"] not in ("library", "torch-gloo")]
        gloo = next((r for r in rs if r["algo"] == "torch-gloo"), None)
        if not lib or not ours:
            continue
        best = min(ours, key=lambda r: r["time_us"])
        auto = next((r for r in ours if r["algo"] == "auto"), None)
        out.append(dict(collective=coll, nranks=n, bytes=size, library_us=lib["time_us"], best_algo=best["algo"],
                        best_us=best["time_us"], best_speedup_vs_library=lib["time_us"] / best["time_us"],
                        gloo_us=gloo["time_us"] if gloo else None,
                        gloo_speedup_vs_library=lib["time_us"] / gloo["time_us"] if gloo else None,
                        auto_us=auto["time_us"] if auto else None))
    return out


def human(b: int) -> str:
    for u, s in ((1 << 20, "M"), (1 << 10, "K")):
        if b >= u:
            return f"{b / u:g}{s}"
    return f"{b}"


def plot(res: dict, png_dir) -> list:
    plt = common.pyplot()
    rows, made = res["rows"], []
    for coll in sorted({r["collective"] for r in rows}):
        ns = sorted({r["nranks"] for r in rows if r["collective"] == coll})
        fig, axes = plt.subplots(2, len(ns), figsize=(3.2 * len(ns), 5.2), squeeze=False, sharex=True)
        for j, n in enumerate(ns):
            rs = [r for r in rows if r["collective"] == coll and r["nranks"] == n and r["placement"] == placement(coll)]
            lib = {r["bytes"]: r["time_us"] for r in rs if r["algo"] == "library"}
            for algo in dict.fromkeys(r["algo"] for r in rs):
                pts = sorted((r["bytes"], r["busbw"], r["time_us"]) for r in rs if r["algo"] == algo)
                style = dict(lw=2, color="k") if algo == "library" else (dict(ls="--") if algo == "torch-gloo" else {})
                axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], label=algo, **style)
                axes[1][j].plot([p[0] for p in pts], [lib[p[0]] / p[2] if p[0] in lib else float("nan") for p in pts],
                                label=algo, **style)
            axes[0][j].set(xscale="log", yscale="log", title=f"{coll}, {n} ranks", ylabel="busbw (GB/s)")
            axes[1][j].set(xscale="log", yscale="log", xlabel="message size (bytes)",
                           ylabel="speed vs library (t_lib / t)")
            axes[1][j].axhline(1.0, color="k", lw=0.6)
        axes[0][-1].legend(fontsize=6)
        where = "in place" if placement(coll) == "in" else "out of place"
        fig.suptitle(f"{coll} ({where}): pympar algorithms vs the MPI library's own vs gloo\n({common.machine()})",
                     fontsize=8)
        made.append(common.save(fig, Path(png_dir) / f"collectives_{coll}.png"))
    return made


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collectives", default="allreduce,reduce_scatter,allgather,alltoall,broadcast")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--max", default="256M", help="largest allreduce message")
    ap.add_argument("--max-other", default="16M", help="largest message of the other collectives")
    ap.add_argument("--factor", type=int, default=8, help="size step (multiply)")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations below 4 MiB")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--large-iters", type=int, default=2, help="timed iterations from 4 MiB on")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default=str(common.RESULTS / "collectives.json"))
    ap.add_argument("--png-dir", default=str(common.ROOT / "docs" / "img"))
    a = ap.parse_args(argv)
    res = run(a)
    common.write_json(a.json, res)
    made = plot(res, a.png_dir)
    print(f"wrote {a.json} {' '.join(map(str, made))}")


if __name__ == "__main__":
    main()
