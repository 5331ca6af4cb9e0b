"""Regenerate every benchmark figure in one command: JSON under bench/results/, PNG under
docs/img/, and docs/benchmarks.md presenting them (bench/report_md.py).

    python bench/run_all.py               # the full suite: about an hour on the 2-core VM
    python bench/run_all.py --quick       # a smoke run of every step, a few minutes (its JSON, PNG
                                          # and doc under bench/results/quick/)
    python bench/run_all.py --only strategies,moe_balance     # some steps; the doc is rewritten
                                                               # from whatever JSON is there
    python bench/run_all.py --report-only  # nothing run: the doc (with its targets table) from the JSON

Each step is one bench script run as a subprocess (so one failing step does not stop the
others: the doc marks it failed). Every comparison is measured side by side inside one
step, so its ratios share one machine load; different steps ran at different times.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import report_md  # noqa: E402

PY = sys.executable
B = common.ROOT / "bench"


TRAIN_SHAPES = [
    ["--preset", "small", "--set", "n_embd=256", "--batch", "8"],
    ["--preset", "small", "--set", "n_layer=6", "--set", "n_embd=512", "--set", "n_head=8", "--set", "block_size=256",
     "--batch", "4"],
    ["--preset", "gpt2-124m", "--batch", "1"],
]


def dirs(quick: bool) -> tuple:
    """(JSON folder, PNG folder): common.output_paths' -- bench/results/ and docs/img/, or for the
    smoke run under bench/results/quick/ (not in git), so that it never replaces what the docs cite."""
    js, png = common.output_paths("x", quick)
    return js.parent, png.parent


def steps(quick: bool) -> list:
    """(name, argv, figure argv or None) in run order."""
    q = quick
    R, IMG = dirs(quick)
    return [
        ("kernels", [PY, B / "cpu_kernels.py", "--sizes", *(["65536"] if q else ["1048576", "16384"]),
                     "--threads", "1", "2", "--min-time", "0.05" if q else "0.2", "--json", R / "kernels.json"],
         ["kernels", R / "kernels.json", IMG / "kernels.png"]),
        # one command per (shape, threads) row; each merges its row into train_step.json. The
        # shapes of issue 14: L4 D256 T128 B8, L6 D512 T256 B4, gpt2-124m at T1024 B1
        ("train_step", [[PY, B / "train_step.py", *shape, "--threads", str(t),
                         "--steps", "2" if q else "4", "--repeat", "1" if q else "3", "--profile", "0",
                         *(["--peers", "sdpa,naive"] if q else []), "--json", R / "train_step.json"]
                        for shape in TRAIN_SHAPES[:1 if q else None] for t in (1, 2)] +
                       # bf16 (issue 43): pympar's mixed precision against the peers under CPU autocast
                       [[PY, B / "train_step.py", *shape, "--threads", str(t), "--dtype", "bfloat16",
                         "--steps", "2" if q else "3", "--repeat", "1" if q else "3", "--profile", "0",
                         "--peers", "sdpa" if q else "sdpa,compile", "--json", R / "train_step.json"]
                        for shape in TRAIN_SHAPES[:1 if q else None] for t in (1, 2)],
         ["train_step", R / "train_step.json", IMG / "train_step.png"]),
        ("ddp_step", [PY, B / "ddp_step.py", "--presets", "small" if q else "small,moe-small", "--world", "2" if q else "2,4",
                      "--rounds", "1" if q else "3", "--steps", "2" if q else "8", "--warmup", "1" if q else "2",
                      "--json", R / "ddp_step.json", "--png", IMG / "ddp_step.png"], None),
        ("collectives", [PY, B / "collectives.py", *(["--ranks", "2,4", "--max", "4M", "--large-iters", "1", "--max-other", "64K",
                                                      "--collectives", "allreduce,allgather", "--factor", "64",
                                                      "--iters", "3"] if q else ["--ranks", "2,4,8", "--max-other", "1M"]),
                         "--json", R / "collectives.json", "--png-dir", IMG], None),
        ("auto_select", [PY, B / "auto_select.py", *(["--ranks", "2", "--max", "1M", "--iters", "50",
                                                      "--transports", "shm,network"] if q else
                                                     ["--ranks", "2,3,4,8"]),    # issue 46's target: p = 2, 3, 4, 8
                         "--json", R / "auto_select.json", "--png-dir", IMG], None),
        ("call_overhead", [PY, B / "call_overhead.py", *(["--ranks", "2", "--rounds", "3", "--calls", "200"] if q else []),
                           "--json", R / "call_overhead.json", "--png", IMG / "call_overhead.png"], None),
        ("pipeline", [PY, B / "pipeline.py", "--launch", "--pp", "2" if q else "2,4", "--m", "2,4" if q else "1,2,4,8,16",
                      "--steps", "2" if q else "4", "--work", "spin", "--block-ms", "1" if q else "2",
                      "--json", R / "pipeline.json"], ["pipeline", R / "pipeline.json", IMG / "pipeline.png"]),
        ("dp_scaling", [PY, B / "dp_scaling.py", "--launch", "--dp", "1,2" if q else "1,2,4", "--bucket-mb", "0.5",
                        "--steps", "3" if q else "10", "--json", R / "dp_scaling.json"],
         ["dp_scaling", R / "dp_scaling.json", IMG / "dp_scaling.png"]),
        ("compression", [PY, B / "compression.py", "--curve-steps", "12" if q else "60", "--json", R / "compression.json",
                         "--png", IMG / "compression.png"], None),
        ("strategies", [PY, B / "strategies.py", "--world", "4" if q else "4,8", "--steps", "2" if q else "5",
                        "--warmup", "1" if q else "2", "--rounds", "1" if q else "2", "--json", R / "strategies.json",
                        "--png", IMG / "strategies.png"], None),
        ("moe_balance", [PY, B / "moe_balance.py", "--steps", "20" if q else "300", "--json", R / "moe_balance.json",
                         "--png", IMG / "experts.png"], None),
        ("moe_experts", [PY, B / "moe_experts.py", *(["--experts", "8,32", "--rows", "1024", "--reps", "2", "--rounds", "1"]
                                                      if q else []),
                         "--json", R / "moe_experts.json", "--png", IMG / "moe_experts.png"], None),
        ("moe_dispatch", [PY, B / "moe_dispatch.py", *(["--quick"] if q else []),
                          "--json", R / "moe_dispatch.json", "--png", IMG / "moe_dispatch.png"], None),
        ("moe_replicas", [PY, B / "moe_replicas.py", *(["--quick"] if q else []),
                          "--json", R / "moe_replicas.json", "--png", IMG / "moe_replicas.png"], None),
        ("moe_fold", [PY, B / "moe_fold.py", *(["--quick"] if q else []),
                      "--json", R / "moe_fold.json", "--png", IMG / "moe_fold.png"], None),
        ("plan_accuracy", [PY, B / "plan_accuracy.py", "--world", "4" if q else "4,8", "--rounds", "1" if q else "3",
                           "--steps", "2" if q else "4", "--calibrate", "--timeout", "120",
                           "--json", R / "plan_accuracy.json", "--png", IMG / "plan_accuracy.png"], None),
        ("attention", [PY, B / "attention.py", *(["--quick"] if q else []), "--json", R / "attention.json",
                       "--png", IMG / "attention.png"], None),
        ("pipeline_head", [common.mpiexec(), "-n", "2", PY, B / "pipeline_head.py",
                           *(["--layers", "2", "--seq", "512", "--pairs", "2"] if q else []),
                           "--json", R / "pipeline_head.json"], None),
        ("gemm", [PY, B / "gemm.py", *(["--threads", "1", "--reps", "2"] if q else []), "--json", R / "gemm.json",
                  "--png", IMG / "gemm.png"], None),
        ("memory", [PY, B / "memory.py", *(["--quick"] if q else []), "--json", R / "memory.json",
                    "--png", IMG / "memory.png"], None),
        ("reproducible", [PY, B / "reproducible.py", *(["--quick"] if q else []), "--json", R / "reproducible.json"],
         None),
        ("param_server", [PY, B / "param_server.py", *(["--quick"] if q else []), "--json", R / "param_server.json"],
         None),
        ("cp_comm", [PY, B / "cp_comm.py", *(["--quick"] if q else []), "--json", R / "cp_comm.json"], None),
        ("cp_hybrid", [PY, B / "cp_comm.py", "--two-nodes", *(["--T", "1024", "--rounds", "1"] if q else []),
                       "--json", R / "cp_hybrid.json"], None),
        ("dualpipe_ep", [PY, B / "dualpipe_ep.py", *(["--quick"] if q else []), "--json", R / "dualpipe_ep.json",
                         "--png", IMG / "dualpipe_ep.png"], None),
        ("soak", [PY, B / "soak.py", "--world", "8", "--preset", "tiny" if q else "small", "--steps", "30" if q else "300",
                  "--save-every", "10" if q else "25", "--json", R / "soak.json", "--png", IMG / "soak.png"], None),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes and few steps: a smoke run")
    ap.add_argument("--only", default="", help="comma-separated step names")
    ap.add_argument("--doc", default=None, help="default docs/benchmarks.md (--quick: bench/results/quick/benchmarks.md)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per step")
    ap.add_argument("--report-only", action="store_true", help="run nothing: rewrite the doc from the JSON there")
    a = ap.parse_args(argv)
    R, IMG = dirs(a.quick)
    a.doc = a.doc or str(R / "benchmarks.md" if a.quick else common.ROOT / "docs" / "benchmarks.md")
    todo = steps(a.quick)
    names = [s[0] for s in todo]
    only = [x for x in a.only.split(",") if x]
    bad = sorted(set(only) - set(names))
    if bad:
        ap.error(f"--only {bad}: the steps are {names}")
    R.mkdir(parents=True, exist_ok=True)
    IMG.mkdir(parents=True, exist_ok=True)
    status_path = R / "run_all_status.json"
    status = json.loads(status_path.read_text()) if status_path.exists() else {}
    for name, cmd, fig in todo:
        if a.report_only or only and name not in only:
            continue
        t0 = time.time()
        cmds = cmd if isinstance(cmd[0], list) else [cmd]          # a step: one command or several in turn
        try:
            for c in cmds:
                print(f"[run_all] {name}: {' '.join(map(str, c[1:]))}", flush=True)
                p = subprocess.run([str(x) for x in c], env=common.env(), cwd=common.ROOT, timeout=a.timeout,
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    break
            ok = p.returncode == 0 or (name == "soak" and p.returncode == 1)     # soak: 1 = growth over the limit
            if ok and fig:
                f = subprocess.run([PY, str(B / "figures.py"), *map(str, fig)], env=common.env(), cwd=common.ROOT,
                                   capture_output=True, text=True, timeout=300)
                ok, p = f.returncode == 0, (p if f.returncode == 0 else f)
            tail = (p.stdout[-2000:] + p.stderr[-2000:]).strip()
        except subprocess.TimeoutExpired:
            ok, tail = False, f"timed out after {a.timeout:.0f} s"
        status[name] = dict(ok=ok, seconds=round(time.time() - t0, 1), quick=a.quick, when=time.strftime("%Y-%m-%d %H:%M"),
                            log_tail=None if ok else tail[-1500:])
        print(f"[run_all] {name}: {'ok' if ok else 'FAILED'} in {time.time() - t0:.0f} s" + ("" if ok else f"\n{tail[-1500:]}"),
              flush=True)
        (R / f"{name}.log").write_text(tail + "\n")
        status_path.write_text(json.dumps(status, indent=1))
    Path(a.doc).write_text(report_md.render(R, status))
    print(f"[run_all] wrote {a.doc}")
    return 0 if all(s["ok"] for n, s in status.items() if not only or n in only) else 1


if __name__ == "__main__":
    sys.exit(main())
