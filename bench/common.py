"""Shared by the bench scripts: launch the trainer or a script under mpiexec, read its
metrics, describe the machine, save small PNG figures.

Every benchmark on this machine oversubscribes 2 cores with several ranks: absolute times
are noise, the ratios of one run are the figures to read (docs/benchmarks.md).
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUICK = RESULTS / "quick"        # smoke runs' outputs (--quick): never the figures the docs cite


def output_paths(name: str, quick: bool = False) -> tuple:
    """(JSON, PNG) a benchmark writes by default: bench/results/NAME.json and docs/img/NAME.png, or
    for a smoke run (--quick) bench/results/quick/NAME.json and bench/results/quick/img/NAME.png (not
    in git; the page run_all writes there finds the images as the docs' page does)."""
    if quick:
        return QUICK / f"{name}.json", QUICK / "img" / f"{name}.png"
    return RESULTS / f"{name}.json", ROOT / "docs" / "img" / f"{name}.png"


def require_native(prog: str) -> None:
    """Exit with one line when pympar._C is missing (a bench would time the reference kernels and
    report that), unless PYMPAR_KERNELS=reference asks for the reference on purpose."""
    from pympar import config, kernels
    if kernels.native_available() or config.read_environment().kernels_reference:
        return
    try:
        kernels.require_native(prog)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


require_native(Path(sys.argv[0]).name or "bench")    # every bench script imports this module first


def env() -> dict:
    """One BLAS/kernel thread per rank (pympar is the installed one: pip install -e . in a checkout)."""
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYMPAR_NUM_THREADS="1")


def best(fn, reps, warm_s=0.0, settle=0.0) -> float:
    """The fastest of ``reps`` calls of fn (seconds), after ``settle`` seconds idle and warm-up calls
    for at least ``warm_s`` seconds (one at least).

    warm_s: one warm-up call was not enough for the first measurement at a new thread count (an
    attention call at T 1024 then ran at the 1-thread speed, 11 ms where the same call later took
    6). settle: OpenBLAS's and OpenMP's worker threads spin a while after a call, and a product
    timed right after another library's ran at 2 threads against 2 spinning threads on 2 cores
    (bench/gemm.py: L6 D512's step GEMMs 770 ms on torch at 2 threads, slower than its 648 at 1)."""
    if settle:
        time.sleep(settle)
    t0 = time.perf_counter()
    fn()
    while time.perf_counter() - t0 < warm_s:
        fn()
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def mpiexec() -> str:
    m = Path(sys.executable).parent / "mpiexec"
    return str(m if m.exists() else "mpiexec")


def launch(n: int, args: list, timeout: float) -> subprocess.CompletedProcess:
    """``mpiexec -n n python args...`` (oversubscribed), output captured."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout, cwd=ROOT)


def worker_parser(doc: str):
    """The parser of a bench script that launches itself as an MPI worker: its own flags, plus
    --worker (hidden: this process is a rank) and --quick (the smoke run)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="a smoke run (its outputs under bench/results/quick/)")
    return ap


def run_worker(n: int, script, args: list, timeout: float, env_extra=None):
    """``mpiexec -n n python script --worker args`` with one kernel thread per rank; the JSON its rank 0
    printed on a line starting "ROWS ". Exits with the command and its output's tail if it failed."""
    e = env()
    e.update({k: str(v) for k, v in (env_extra or {}).items()})
    cmd = [mpiexec(), "-n", str(n), sys.executable, str(script), "--worker", *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=ROOT, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("ROWS "))[5:])


def run_with_peaks(n: int, args: list, timeout: float, environ=None):
    """mpiexec -n n python args, each rank under /usr/bin/time writing its peak RSS (VmHWM as the
    kernel counts it, read after the rank exits) to a file: (completed process, {rank: peak bytes});
    environ: the ranks' environment (default env())."""
    with tempfile.TemporaryDirectory() as d:
        inner = " ".join(["exec", "/usr/bin/time", "-o", shlex.quote(d) + "/peak_$PMI_RANK", "-f", "%M",
                          *[shlex.quote(str(a)) for a in (sys.executable, *args)]])
        p = subprocess.run([mpiexec(), "-n", str(n), "sh", "-c", inner], capture_output=True, text=True,
                           env=environ or env(), timeout=timeout, cwd=ROOT)
        peaks = {int(f.name.split("_")[1]): int(f.read_text().split()[-1]) * 1024 for f in Path(d).glob("peak_*")}
    return p, peaks


def read_jsonl(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_argv(args: list, out: str) -> list:
    """``-m pympar.train`` with args, writing to out: no samples, log progress, no evaluation unless
    args ask for it (what train() runs on each rank)."""
    extra = [] if "--eval-every" in args else ["--eval-every", "0"]
    return ["-m", "pympar.train", "--out", out, "--sample-tokens", "0", "--progress", "log", *extra,
            *map(str, args)]


def train(n: int, args: list, timeout: float = 600, out: str | None = None) -> list:
    """Run ``python -m pympar.train`` on n ranks; -> its metrics.jsonl records.

    Raises RuntimeError with the trainer's last output when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        d = out or tmp
        p = launch(n, train_argv(args, d), timeout)
        if p.returncode != 0:
            raise RuntimeError(f"pympar.train -n {n} {' '.join(map(str, args))} failed ({p.returncode}):\n"
                               f"{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
        return read_jsonl(Path(d) / "metrics.jsonl")


def steady(records: list, skip: int = 1) -> list:
    """The records after the first ``skip`` steps (warm-up)."""
    return records[skip:] or records


def median(records: list, key: str) -> float:
    return statistics.median(r[key] for r in records)


def machine() -> str:
    """One line naming the machine, for titles and docs."""
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f", {int(f.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return f"{os.cpu_count()} cores{cpu_model()}{mem}, {platform.machine()}, no GPU; ranks oversubscribe the cores"


def cpu_model() -> str:
    """" (model, its bf16 units)" from /proc/cpuinfo, e.g. " (AMD EPYC, AVX512-BF16, no AMX)": which
    CPU a result came from (sessions land on different ones), empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read(1 << 16)
    except OSError:
        return ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    units = next((name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16, no AMX"),
                                          ("avx512f", "AVX-512, no bf16")) if flag in flags), "no AVX-512")
    model = fields.get("model name", "")
    return f" ({model}, {units})" if model else f" ({units})"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "figure.dpi": 80})
    return plt


def save(fig, path) -> Path:
    """Save a figure small (< 100 KB): modest dpi, PNG with a reduced palette when PIL is there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    try:
        from PIL import Image

        im = Image.open(path).convert("RGB").quantize(colors=64)
        im.save(path, optimize=True)
    except ImportError:
        pass
    return path


def write_json(path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))
    return path


def add_output_args(ap, name: str):
    """--json and --png of a benchmark script, by default output_paths(NAME, --quick)."""
    ap.add_argument("--json", default=None, help=f"default bench/results/{name}.json (--quick: bench/results/quick/)")
    ap.add_argument("--png", default=None, help=f"default docs/img/{name}.png (--quick: bench/results/quick/)")
    ap.set_defaults(output_name=name)


def resolve_outputs(a):
    """Fill a.json and a.png left unset with output_paths(a.output_name, a.quick); a."""
    js, png = output_paths(a.output_name, getattr(a, "quick", False))
    a.json, a.png = a.json or str(js), a.png or str(png)
    return a


def write_outputs(a, res, plot) -> None:
    """The result as JSON at a.json, plot(res, a.png) (both resolved at parse time: resolve_outputs),
    and a line saying where both went."""
    write_json(a.json, res)
    plot(res, a.png)
    print(f"wrote {a.json} {a.png}")


def run_and_write(ap, argv, name: str, run, plot):
    """A benchmark's main: parse argv (with add_output_args), res = run(args), write_outputs; res."""
    add_output_args(ap, name)
    a = resolve_outputs(ap.parse_args(argv))
    res = run(a)
    write_outputs(a, res, plot)
    return res
