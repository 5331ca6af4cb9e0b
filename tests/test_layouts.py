"""The central claim under mpiexec: every layout dp x pp x cp x tp (ep | dp x cp) of world size 1, 2, 4 and 8
trains the single-process run (tests/mpi/mpi_layouts.py; the layouts in tests/mpi/layout_cases.py).

One launch per world size runs all its layouts. CI runs the all-pairs slice (``ci_layouts``); the
whole matrix is ``python -m pytest -m slow tests/test_layouts.py``. Each run checks that the launch
covered exactly the layouts enumerated here, and prints how many it ran and how long it took.
"""
import json
import re
import sys
from pathlib import Path

import pytest

from mpirun import ROOT, run_pytest_mpi
from pympar.backend import gpu_available

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from layout_cases import WORLDS, all_layouts, ci_layouts  # noqa: E402

pytestmark = pytest.mark.mpi


def _run(n, mode, timeout, device="cpu", env=None):
    res = run_pytest_mpi(n, "mpi_layouts.py", timeout=timeout, extra_args=("-s",),
                         env={"PYMPAR_LAYOUTS": mode, "PYMPAR_LAYOUTS_DEVICE": device, **(env or {})})
    m = re.search(r"LAYOUTS world=(\d+) mode=(\w+) device=(\w+) ran=(\d+) failed=(\d+) seconds=([\d.]+)(.*)",
                  res.stdout)
    assert m, f"no LAYOUTS summary line in the output:\n{res.stdout[-3000:]}"
    print(m.group(0))
    assert m.group(3) == device
    routes = re.search(r"node_routes=(\d+)", m.group(7))
    _run.node_routes = int(routes.group(1)) if routes else 0
    return int(m.group(4)), int(m.group(5))


@pytest.mark.parametrize("n", WORLDS)
def test_ci_slice_of_layouts_matches_single_process(n):
    ran, failed = _run(n, "ci", timeout=300 if n == 8 else 120)
    assert (ran, failed) == (len(ci_layouts(n)), 0)


def test_ci_slice_of_expert_layouts_over_simulated_nodes_dispatches_node_aware():
    """The slice's expert-parallel layouts at 4 ranks on 2 simulated nodes of 2: where an ep group
    spans both nodes the trainer's --ep-dispatch auto takes the node-aware route (composed with
    tp, pp, cp, ZeRO and recomputation as the slice has them), and every layout still matches the
    single process."""
    n = 4
    want = [lay for lay in ci_layouts(n) if lay.ep > 1]
    ran, failed = _run(n, "ci", timeout=180, env={"PYMPAR_RANKS_PER_NODE": 2, "PYMPAR_LAYOUTS_WHERE": "ep=2|4"})
    assert (ran, failed) == (len(want), 0)
    assert _run.node_routes > 0, "no layout of the slice dispatched node-aware"


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a visible GPU")
@pytest.mark.parametrize("n", [1, 2, 4])
def test_ci_slice_of_layouts_on_gpus_matches_single_process(n):
    """The same slice with every rank's parameters, activations and gradients on a GPU (CuPy),
    against the host single-process reference: the whole slice (every dimension's values, ZeRO 0-3,
    bf16, cp) on the device path."""
    ran, failed = _run(n, "ci", timeout=600, device="cuda")
    assert (ran, failed) == (len(ci_layouts(n)), 0)


@pytest.mark.slow
@pytest.mark.timeout(7300)                 # the 8-rank matrix: 4,572 layouts
@pytest.mark.parametrize("n", WORLDS)
def test_every_layout_matches_single_process(n):
    ran, failed = _run(n, "full", timeout=7200)
    assert (ran, failed) == (len(all_layouts(n)), 0)


def test_the_documented_layout_counts_are_the_enumerated_ones():
    """README.md and docs/parallel.md say how many layouts CI and the full matrix run, and how many
    of CI's are Ulysses and a2a+ring: the counts the code enumerates (a new dimension value changes
    them, and the pages with them)."""
    slices = {n: ci_layouts(n) for n in WORLDS}
    ci = [len(slices[n]) for n in WORLDS]
    full = [len(all_layouts(n)) for n in WORLDS]

    def num(s):
        return int(s.replace(",", ""))
    readme = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"of ([\d,]+) layouts \(([\d,]+), ([\d,]+), ([\d,]+) and ([\d,]+) at 1, 2, 4 and 8 ranks\)", readme)
    assert m and [num(x) for x in m.groups()] == [sum(ci), *ci], (m and m.groups(), ci)
    m = re.search(r"matrix of ([\d,]+) layouts \(([\d,]+), ([\d,]+), ([\d,]+) and ([\d,]+)\)", readme)
    assert m and [num(x) for x in m.groups()] == [sum(full), *full], (m and m.groups(), full)
    table = (ROOT / "docs" / "parallel.md").read_text()
    rows = [(str(n), c, f) for n, c, f in zip(WORLDS, ci, full)] + [("all", sum(ci), sum(full))]
    for w, c, f in rows:
        assert f"| {w} | {c} | {f:,} |" in table, (w, c, f)
    flat = " ".join(table.split())
    a2a = [sum(x.cp > 1 and x.cp_comm == "a2a" for x in slices[n]) for n in (2, 4, 8)]
    hybrid = [sum(x.cp_comm == "a2a+ring" for x in slices[n]) for n in (4, 8)]
    assert "the CI slice runs {}, {} and {} Ulysses layouts at 2, 4 and 8 ranks and {} and {} a2a+ring layouts at 4 " \
        "and 8 ranks".format(*a2a, *hybrid) in flat, (a2a, hybrid)
    assert "the CI slice runs {} and {} of these layouts at 4 and 8 ranks".format(*hybrid) in flat, hybrid


def test_ci_slice_covers_every_pair_of_dimension_values():
    """The slice is representative: each pair of values of (shape, ep, model, schedule, sp, zero,
    dtype) that occurs in the full matrix occurs in the slice; every dimension value occurs."""
    from layout_cases import _pairs, all_layouts as full

    for n in WORLDS:
        want = set().union(*(_pairs(x) for x in full(n, dtypes=("float64", "float32", "bfloat16"))))
        got = set().union(*(_pairs(x) for x in ci_layouts(n)))
        assert want == got, (n, sorted(want - got)[:5])
    assert len(all_layouts(8)) > 100
    assert {x.schedule for x in all_layouts(8) if x.pp > 1} == {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"}
    assert {x.schedule for x in all_layouts(8) if x.pp == 1} == {"1f1b"}
    assert {x.cp for x in all_layouts(8)} == {1, 2, 4}


# ----------------------------------------------------------------------------- the trainer's CLI

CLI = ["-m", "pympar.train", "--block-size", "16", "--micro-batch-size", "2", "--sample-tokens", "8",
       "--eval-iters", "3", "--eval-every", "2", "--steps", "3", "--progress", "log"]


def _losses(n, out, *args, timeout=120):
    """A run's metrics rows; float32 unless the case names a dtype (the default, auto, is bf16 on a
    CPU with native bf16 products: these cases compare layouts, at float32's tolerance)."""
    from mpirun import run_mpi

    args = [*args] if "--dtype" in args else [*args, "--dtype", "float32"]
    res = run_mpi(n, [*CLI, "--out", out, *map(str, args)], timeout=timeout)
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return res, rows


@pytest.mark.parametrize("args, n_micro", [
    (["--preset", "tiny", "--pp", 2, "--tp", 2], 4),
    (["--preset", "tiny", "--dp", 2, "--tp", 2, "--seq-parallel", "--zero", 1], 2),
    (["--preset", "moe-tiny", "--dp", 2, "--pp", 2, "--ep", 2, "--schedule", "gpipe"], 2),
    (["--preset", "moe-tiny", "--dp", 4, "--ep", 2, "--zero", 1], 1),
    (["--preset", "moe-tiny", "--dp", 2, "--pp", 2, "--ep", 2, "--zero", 1, "--dtype", "float16"], 2),
    (["--preset", "tiny", "--dp", 2, "--pp", 2, "--schedule", "interleaved", "--virtual-stages", 2,
      "--n-layer", 4, "--compress", "bf16", "--dtype", "bfloat16"], 2),
    (["--preset", "tiny", "--dp", 2, "--tp", 2, "--zero", 3, "--dtype", "bfloat16"], 2),
    (["--preset", "moe-tiny", "--dp", 2, "--pp", 2, "--ep", 2, "--zero", 2, "--recompute", "full"], 2),
    (["--preset", "moe-tiny", "--pp", 2, "--cp", 2, "--ep", 2, "--schedule", "zb-h1", "--zero", 1], 4),
    (["--preset", "tiny", "--n-layer", 5, "--dp", 2, "--pp", 2, "--schedule", "zb-v", "--zero", 3,
      "--pp-channels", "ordered", "--pp-costs", "measured"], 2),
    (["--preset", "moe-tiny", "--cp", 4, "--cp-comm", "a2a+ring", "--cp-a2a", 2, "--ep", 2], 4),
    (["--preset", "moe-tiny", "--n-head", 4, "--tp", 4, "--ep", 2, "--etp", 1], 4),
    (["--preset", "moe-tiny", "--n-layer", 4, "--pp", 2, "--cp", 2, "--cp-comm", "a2a", "--ep", 2,
      "--schedule", "dualpipev", "--pp-overlap", "on"], 4),
], ids=["pp2-tp2", "dp2-tp2-sp-zero1", "dp2-pp2-ep2-gpipe", "dp4-ep2-zero1", "dp2-pp2-ep2-zero1-float16",
        "dp2-pp2-interleaved-bf16sync-bfloat16", "dp2-tp2-zero3-bfloat16", "dp2-pp2-ep2-zero2-recompute",
        "pp2-cp2-ep2-zb-h1-zero1", "dp2-pp2-zb-v-zero3-ordered-measured-5-layers",
        "cp4-a2a2+ring-ep2", "tp4-ep2-etp1-folded", "pp2-cp2-a2a-ep2-dualpipev-overlap"])
def test_cli_layout_matches_one_process(tmp_path, args, n_micro):
    """python -m pympar.train on 4 ranks == on 1 rank with the same global batch (4 micro-batches)
    and compute dtype: losses, grad norms and validation losses per step (rel 1e-5; 1e-4 where
    the compute dtype is float16/bfloat16: its products are rounded to 11 or 8 bits, so another
    summation order over ranks shows at ~1e-5 after one update -- zero 0 and 1 alike; the grad norm
    of a bf16 tensor-parallel run to 1e-3: a row-parallel layer's float32 partial sums, added in
    another order, tip a bf16 rounding (2^-8) here and there, and the norm squares what it sums --
    measured 1.9e-4 at dp2 tp2 ZeRO-3)."""
    same = [x for k in ("--preset", "--dtype", "--n-layer", "--n-head") if k in args
            for x in (k, args[args.index(k) + 1])]
    preset = args[args.index("--preset") + 1]
    _, one = _losses(1, tmp_path / "one", *same, "--n-micro", 4)
    # a lossy (bf16) gradient sync changes the math on purpose: close, not equal
    tol = 1e-2 if "--compress" in args else (1e-4 if "--dtype" in args else 1e-5)
    res, four = _losses(4, tmp_path / "four", *args, "--n-micro", n_micro)
    assert "layout dp=" in res.stdout and res.stdout.count("--- sample (top-k) ---") == 1
    if "--cp-comm" in args:                              # the start-up line names what runs
        u = args[args.index("--cp-a2a") + 1] if "--cp-a2a" in args else 0
        assert f"({args[args.index('--cp-comm') + 1]}{f' in groups of {u}' if u else ''})" in res.stdout
    if "dualpipev" in args:
        assert "DualPipeV's F & B pairs interleaved (--pp-overlap on)" in res.stdout, res.stdout
    assert len(one) == len(four) > 0 and [a["step"] for a in one] == [b["step"] for b in four]
    for a, b in zip(one, four):
        for k in ("loss", "grad_norm", "val_loss"):
            if a[k] is not None:
                rel = 1e-3 if (k == "grad_norm" and "--tp" in args and "bfloat16" in args) else tol
                assert b[k] == pytest.approx(a[k], rel=rel), (k, a["step"], a[k], b[k])
        if preset.startswith("moe"):
            assert [m["tokens_per_expert"] for m in a["moe"]] == [m["tokens_per_expert"] for m in b["moe"]]
    split = four[-1]["time_split"]
    assert split["compute"] > 0 and split["optimizer"] > 0
    assert (split["pp_comm"] > 0) == ("--pp" in args) and (split["tp_comm"] > 0) == ("--tp" in args)
    assert (split["ep_comm"] > 0) == ("--ep" in args)
    # the gradient sync spans ranks: the dense one over dp x cp, the folded experts' over edp (tp 4 / ep 2 here)
    assert (split["dp_comm"] > 0) == ("--dp" in args or "--cp" in args or "--etp" in args)
    if "--pp-costs" in args:                  # step 0 ran the unit-time table, then the measured times' one
        tables = [b.get("pp_table_costs") for b in four]
        assert tables[0] is None and all(t == tables[1] and len(t) == 4 for t in tables[1:]), tables


@pytest.mark.parametrize("dtype, extra", [("bfloat16", []), ("float16", ["--seq-parallel"])],
                         ids=["tp2-bfloat16", "tp2-sp-float16"])
def test_cli_tensor_parallel_mixed_precision_matches_one_process(tmp_path, dtype, extra):
    """--tp 2 --dtype bfloat16/float16 (fp16: loss scaling) on 2 ranks == 1 rank with the same
    compute dtype, to low-precision tolerance (partial sums over tp are reduced in float32 and
    rounded once, so only rounding-order effects remain): losses and validation loss to rel 2e-4,
    grad norms to 1% (docs/parallel.md: a 200-step bf16 run stayed within 1.2e-4 in loss, 0.7%
    in grad norm)."""
    _, one = _losses(1, tmp_path / "one", "--preset", "tiny", "--dtype", dtype, "--n-micro", 2)
    res, two = _losses(2, tmp_path / "two", "--preset", "tiny", "--dtype", dtype, "--tp", 2, *extra,
                       "--n-micro", 2)
    assert "layout dp=" in res.stdout and len(one) == len(two) > 0 and [a["step"] for a in one] == [b["step"] for b in two]
    for a, b in zip(one, two):
        for k, rel in (("loss", 2e-4), ("grad_norm", 1e-2), ("val_loss", 2e-4)):
            if a[k] is not None:
                assert b[k] == pytest.approx(a[k], rel=rel), (k, a["step"], a[k], b[k])
    assert two[-1]["time_split"]["tp_comm"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a visible GPU")
@pytest.mark.parametrize("args, n_micro", [
    (["--preset", "tiny", "--pp", 2, "--tp", 2], 4),
    (["--preset", "moe-tiny", "--dp", 2, "--pp", 2, "--ep", 2, "--schedule", "gpipe"], 2),
    (["--preset", "tiny", "--dp", 2, "--tp", 2, "--seq-parallel", "--zero", 1], 2),
], ids=["pp2-tp2", "dp2-pp2-ep2-gpipe", "dp2-tp2-sp-zero1"])
def test_cli_layout_on_gpus_matches_one_cpu_process(tmp_path, args, n_micro):
    """python -m pympar.train --device cuda on 4 ranks == one CPU process with the same global
    batch: losses, grad norms and validation losses per step (float32; cuBLAS and the host BLAS
    sum in different orders, hence rel 1e-3)."""
    preset = args[args.index("--preset") + 1]
    _, one = _losses(1, tmp_path / "one", "--preset", preset, "--n-micro", 4)
    res, four = _losses(4, tmp_path / "four", *args, "--device", "cuda", "--n-micro", n_micro, timeout=300)
    assert "layout dp=" in res.stdout and len(one) == len(four) > 0 and [a["step"] for a in one] == [b["step"] for b in four]
    for a, b in zip(one, four):
        for k in ("loss", "grad_norm", "val_loss"):
            if a[k] is not None:
                assert b[k] == pytest.approx(a[k], rel=1e-3), (k, a["step"], a[k], b[k])
        if preset.startswith("moe"):
            assert [m["tokens_per_expert"] for m in a["moe"]] == [m["tokens_per_expert"] for m in b["moe"]]
    assert 0 < four[-1]["mfu"] < 1                           # against the datasheet bf16 peak
