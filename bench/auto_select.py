"""algo="auto" against every choice it has, on shared memory and on MPICH's network transport.

For each transport and rank count, one ``python -m pympar.bench <collective> --algo all``
run: auto (which measures its choice per size bucket in its warm-up, agreed over the
ranks), every pympar algorithm, pympar's wrapper of the library's call (``mpi``) and the
library's call made directly through mpi4py (``library``). Per size, "best" is the fastest
of all of them (the library's direct call included: auto must never lose to it); auto/best
is the time ratio (1.0: auto ran the fastest choice); chosen_row_over_best compares the row
of the algorithm auto chose instead (the decision's quality without the noise between two
rows of the same algorithm), and auto_over_chosen_row is that noise (auto's row over the row
of the algorithm it ran: two timings of one algorithm); decision_us is what auto's measurement
saw per candidate. auto_over_best_median: auto/best by each row's median round instead of its
fastest (the best row's fastest round is the luckiest of many: with 9 rows of 3 rounds, one
lucky round sets "best"). Time: the slowest rank's mean over the iterations, as
nccl-tests, in the fastest of --rounds alternating rounds (every choice timed once per round,
so two rows are compared at the same moments of an oversubscribed run); allreduce out of place.

Transports (MPICH, this machine's ranks):
  shm      the default: ranks of a node share memory (MPICH's shm transport, pympar's shm);
  network  MPIR_CVAR_NOLOCAL=1: every message through the network module, every rank its
           own node -- what ranks on different nodes use;
  2nodes   MPIR_CVAR_NUM_CLIQUES=2: two "nodes" whose ranks share memory, network between
           them (hierarchical's inter-node leg on the network transport).

    python bench/auto_select.py                                  # 2, 4, 8 ranks, both transports
    python bench/auto_select.py --ranks 2 --transports shm --max 1M \
        --json bench/results/quick/auto_select.json --png-dir bench/results/quick     # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from collectives import human, parse_size  # noqa: E402

TRANSPORTS = {"shm": {}, "network": {"MPIR_CVAR_NOLOCAL": "1"}, "2nodes": {"MPIR_CVAR_NUM_CLIQUES": "2"}}
MID, LARGE = 128 << 10, 4 << 20     # size bands: -n iters below MID, --mid-iters to LARGE, --large-iters from it
TARGET = 1.15


def one(coll, n, transport, lo, hi, factor, iters, warmup, timeout, rounds=1):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [common.mpiexec(), "-n", str(n), sys.executable, "-m", "pympar.bench", coll, "-b", str(lo), "-e", str(hi),
               "-f", str(factor), "-n", str(iters), "-w", str(warmup), "-c", "0", "--algo", "all", "--no-torch",
               "--rounds", str(rounds),
               "--json", str(out)]
        env = dict(common.env(), **TRANSPORTS[transport])
        env.pop("PYMPAR_TUNING", None)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=common.ROOT)
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(cmd)} ({transport}) failed ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
        d = json.loads(out.read_text())
        return d["rows"], d.get("shape")


def _median(row):
    """A row's median round (its time_us is its fastest: the best of a few noisy rounds)."""
    rs = sorted(row.get("rounds_us") or [row["time_us"]])
    return (rs[(len(rs) - 1) // 2] + rs[len(rs) // 2]) / 2


def summarize(rows):
    out = []
    for key in sorted({(r["collective"], r["transport"], r["nranks"], r["bytes"]) for r in rows}):
        rs = [r for r in rows if (r["collective"], r["transport"], r["nranks"], r["bytes"]) == key
              and r["placement"] == "out"]
        auto = next((r for r in rs if r["algo"] == "auto"), None)
        others = [r for r in rs if r["algo"] != "auto"]
        if auto is None or not others:
            continue
        best = min(others, key=lambda r: r["time_us"])
        lib = next(r for r in rs if r["algo"] == "library")
        chosen = next((r for r in rs if r["algo"] == auto.get("chosen")), None)
        out.append(dict(collective=key[0], transport=key[1], nranks=key[2], bytes=key[3], auto_us=auto["time_us"],
                        chosen=auto.get("chosen"), best_algo=best["algo"], best_us=best["time_us"],
                        auto_over_best=auto["time_us"] / best["time_us"],
                        chosen_row_over_best=chosen["time_us"] / best["time_us"] if chosen else None,
                        auto_over_chosen_row=auto["time_us"] / chosen["time_us"] if chosen else None,
                        auto_over_best_median=_median(auto) / min(_median(r) for r in others),
                        decision_us=auto.get("decision_us"),
                        library_us=lib["time_us"], library_over_auto=lib["time_us"] / auto["time_us"]))
    return out


def run(a):
    rows, shapes = [], {}
    hi = parse_size(a.max)
    for coll in a.collectives.split(","):
        for transport in a.transports.split(","):
            for n in [int(x) for x in a.ranks.split(",")]:
                if transport == "2nodes" and n < 4:
                    continue
                got = []
                bands = [(parse_size(a.min), min(hi, MID // a.factor), a.iters, a.warmup),
                         (MID, min(hi, LARGE // a.factor), a.mid_iters, 3), (LARGE, hi, a.large_iters, 1)]
                shape = None
                for lo_b, hi_b, iters, warm in bands:
                    if lo_b <= hi_b:
                        part, shape = one(coll, n, transport, lo_b, hi_b, a.factor, iters, warm, a.timeout, a.rounds)
                        got += part
                for r in got:
                    r.update(collective=coll, nranks=n, transport=transport)
                rows += got
                shapes[f"{transport}/{n}"] = shape
                s = [x for x in summarize(got)]
                worst = max(s, key=lambda x: x["auto_over_best"])
                print(f"  {coll} {transport} n={n} ({shape}): auto/best max {worst['auto_over_best']:.2f} "
                      f"at {worst['bytes']} B", file=sys.stderr, flush=True)
    return dict(kind="auto_select", machine=common.machine(), target=TARGET, rounds=a.rounds, shapes=shapes, rows=rows,
                summary=summarize(rows))


def plot(res, png_dir):
    plt = common.pyplot()
    made = []
    summ = res["summary"]
    for coll in sorted({s["collective"] for s in summ}):
        for transport in [t for t in TRANSPORTS if any(s["transport"] == t and s["collective"] == coll for s in summ)]:
            ns = sorted({s["nranks"] for s in summ if s["transport"] == transport and s["collective"] == coll})
            fig, axes = plt.subplots(2, len(ns), figsize=(3.3 * len(ns), 5.4), squeeze=False, sharex=True)
            for j, n in enumerate(ns):
                rs = [r for r in res["rows"] if r["collective"] == coll and r["transport"] == transport
                      and r["nranks"] == n and r["placement"] == "out"]
                best = {s["bytes"]: s["best_us"] for s in summ if s["collective"] == coll
                        and s["transport"] == transport and s["nranks"] == n}
                for algo in dict.fromkeys(r["algo"] for r in rs):
                    pts = sorted((r["bytes"], r["time_us"]) for r in rs if r["algo"] == algo)
                    style = (dict(lw=2.2, color="k") if algo == "library" else
                             dict(lw=2.2, color="tab:red", marker="o", ms=3) if algo == "auto" else dict(lw=0.9))
                    axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], label=algo, **style)
                    axes[1][j].plot([p[0] for p in pts], [p[1] / best[p[0]] for p in pts], label=algo, **style)
                axes[0][j].set(xscale="log", yscale="log", title=f"{n} ranks", ylabel="time (us, slowest rank)")
                axes[1][j].set(xscale="log", yscale="log", ylim=(0.9, 8), xlabel="message size (bytes)",
                               ylabel="time / fastest choice")
                axes[1][j].axhline(TARGET, color="tab:red", lw=0.6, ls="--")
            axes[0][-1].legend(fontsize=6)
            fig.suptitle(f"{coll}, {transport} transport: auto (red) vs every choice; dashed: {TARGET}x target\n"
                         f"({common.machine()})", fontsize=8)
            made.append(common.save(fig, Path(png_dir) / f"auto_{coll}_{transport}.png"))
        if any("auto_over_best_median" in s for s in res["summary"]):     # what report_md shows it for
            made.append(bars(res, coll, png_dir))
    return made


def bars(res, coll, png_dir):
    """One bar per (transport, ranks, size): auto's row over the best row (the target's measure),
    a dot for the same by each row's median round; the target as a dashed line."""
    plt = common.pyplot()
    summ = [s for s in res["summary"] if s["collective"] == coll]
    trs = [t for t in TRANSPORTS if any(s["transport"] == t for s in summ)]
    fig, axes = plt.subplots(len(trs), 1, figsize=(9, 2.3 * len(trs)), squeeze=False)
    for ax, tr in zip(axes[:, 0], trs):
        within = [s for s in summ if s["transport"] == tr]
        ns = sorted({s["nranks"] for s in within})
        sizes = sorted({s["bytes"] for s in within})
        w = 0.8 / len(ns)
        for k, n in enumerate(ns):
            pts = [(i, s) for i, b in enumerate(sizes) for s in within if s["nranks"] == n and s["bytes"] == b]
            xs = [i - 0.4 + w * (k + 0.5) for i, _ in pts]
            ax.bar(xs, [s["auto_over_best"] - 1 for _, s in pts], w, bottom=1, label=f"{n} ranks")
            med = [(x, s["auto_over_best_median"]) for x, (_, s) in zip(xs, pts) if "auto_over_best_median" in s]
            ax.plot([m[0] for m in med], [m[1] for m in med], "k.", ms=3)
        ok = sum(1 for s in within if s["auto_over_best"] <= TARGET)
        ax.axhline(TARGET, color="tab:red", lw=0.8, ls="--")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_xticks(range(len(sizes)), [human(b) for b in sizes])
        vals = [s[f] for s in within for f in ("auto_over_best", "auto_over_best_median") if f in s]
        ax.set(ylabel="auto / best row", ylim=(min([0.75] + vals) - 0.05, max([1.55] + vals) + 0.05),
               title=f"{tr}: {ok} of {len(within)} points within {TARGET}x")
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axes[-1][0].set_xlabel("message size (bytes); bars: fastest round of each row; dots: median round")
    fig.suptitle(f"{coll}: auto's time over the fastest choice's, per size and rank count ({common.machine()})",
                 fontsize=8)
    return common.save(fig, Path(png_dir) / f"auto_{coll}_bars.png")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collectives", default="allreduce")
    ap.add_argument("--transports", default="shm,network,2nodes")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--min", default="16")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per size; each row is its fastest")
    ap.add_argument("--iters", type=int, default=200, help="timed iterations per round below 128 KiB")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--mid-iters", type=int, default=30, help="timed iterations per round from 128 KiB to 4 MiB")
    ap.add_argument("--large-iters", type=int, default=3, help="timed iterations per round from 4 MiB on")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default=str(common.RESULTS / "auto_select.json"))
    ap.add_argument("--png-dir", default=str(common.ROOT / "docs" / "img"))
    a = ap.parse_args(argv)
    os.environ.pop("PYMPAR_TUNING", None)
    res = run(a)
    common.write_json(a.json, res)
    made = plot(res, a.png_dir)
    print(f"wrote {a.json} {' '.join(map(str, made))}")


if __name__ == "__main__":
    main()
