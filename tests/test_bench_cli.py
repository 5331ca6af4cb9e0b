"""python -m pympar.bench: help, a short run of every collective with the table and JSON."""
import json
import subprocess
import sys

import numpy as np
import pytest

from mpirun import ROOT, mpi_env, run_mpi

pytestmark = pytest.mark.mpi


@pytest.fixture
def bench_module(monkeypatch):
    """Import a module of bench/ (which imports its siblings) with bench/ on sys.path for this test
    only: sys.path and sys.modules are left as they were. bench/ on the path for the rest of the
    session puts its scripts where other packages' probes look (transformers imported
    bench/kernels.py as the `kernels` package, before that script was renamed)."""
    import importlib

    bench = ROOT / "bench"
    monkeypatch.syspath_prepend(str(bench))
    before = set(sys.modules)
    yield importlib.import_module
    for name in set(sys.modules) - before:
        if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(bench)):
            del sys.modules[name]


def test_help_explains_the_columns():
    p = subprocess.run([sys.executable, "-m", "pympar.bench", "--help"], capture_output=True, text=True,
                       env=mpi_env(), cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    for word in ("busbw", "--algo", "--tune", "library", "torch-gloo", "allreduce", "latency", "osu", "--explain",
                 "not yet run on a GPU"):
        assert word in " ".join(p.stdout.split())


@pytest.mark.parametrize("coll", ["allreduce", "alltoall", "alltoallv"] + [
    pytest.param(c, marks=pytest.mark.slow) for c in ("reduce_scatter", "allgather", "broadcast", "sendrecv")])
def test_every_collective_runs_and_checks(coll, tmp_path):
    out = tmp_path / "b.json"
    p = run_mpi(3, ["-m", "pympar.bench", coll, "-b", "8", "-e", "4K", "-f", "16", "-n", "2", "-w", "1",
                    "--algo", "all", "--no-torch", "--json", out, "--tune", tmp_path / "t.json"], timeout=120)
    assert "Avg bus bandwidth" in p.stdout and "Out of bounds values : 0 OK" in p.stdout, p.stdout
    d = json.loads(out.read_text())
    assert d["nranks"] == 3 and d["rows"] and all(r["wrong"] == 0 for r in d["rows"])
    assert {"auto", "library"} <= {r["algo"] for r in d["rows"]}      # pympar's own call in every --algo all
    assert {r["redop"] for r in d["rows"]} == ({"sum"} if coll in ("allreduce", "reduce_scatter") else {"none"})


def test_tune_file_drives_auto_and_another_shape_is_ignored(tmp_path):
    t = tmp_path / "tune.json"
    p = run_mpi(2, ["-m", "pympar.bench", "allreduce", "-b", "1K", "-e", "64K", "-f", "8", "-n", "2", "-w", "1",
                    "--algo", "ring", "-c", "0", "--tune", t], timeout=120)
    data = json.loads(t.read_text())
    assert data["format"] == "pympar-tuning/2" and set(data["machine"]) == {"cpu", "mpi"}
    entries = data["shapes"]["2r-1n-2rpn"]["allreduce"]["float32"]
    assert sorted(int(b) for b in entries) == [10, 13, 16]          # 1 KiB, 8 KiB, 64 KiB
    for e in entries.values():     # --tune weighs every choice, not only the --algo given
        assert {"mpi", "ring", "recursive_doubling", "rabenseifner", "shm"} <= set(e["times_us"])
        assert e["algo"] in e["times_us"]
    # the file drives auto: force a choice into it and see auto name it
    entries["13"]["algo"] = "rabenseifner"
    t.write_text(json.dumps(data))
    p = run_mpi(2, ["-m", "pympar.bench", "allreduce", "-b", "8K", "-e", "8K", "-n", "1", "-w", "0", "--explain"],
                timeout=60, env={"PYMPAR_TUNING": t})
    assert "auto(rabenseifner)" in p.stdout and "(file)" in p.stdout and "0 OK" in p.stdout, p.stdout
    # at 3 ranks the file has no entries: a warning, and auto measures
    p = run_mpi(3, ["-m", "pympar.bench", "allreduce", "-b", "8K", "-e", "8K", "-n", "1", "-w", "0", "--explain"],
                timeout=60, env={"PYMPAR_TUNING": t})
    assert "TuningWarning" in p.stdout and "no entries for communicator 'world' of shape 3r-1n-3rpn" in p.stdout
    assert "(measured)" in p.stdout and "0 OK" in p.stdout, p.stdout


@pytest.mark.parametrize("kind", ["latency", "bw"])
def test_osu_point_to_point_against_mpi4py(kind, tmp_path):
    out = tmp_path / "p.json"
    p = run_mpi(2, ["-m", "pympar.bench", kind, "-e", "16K", "-f", "16", "-n", "20", "-w", "2", "--large-iters", "3",
                    "--json", out], timeout=60)
    assert "Wrong bytes received : 0 OK" in p.stdout, p.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"pympar", "mpi4py"}
    assert sorted({r["bytes"] for r in rows}) == [0, 1, 16, 256, 4096]
    key = "latency_us" if kind == "latency" else "bandwidth_MBps"
    assert all(r[key] > 0 for r in rows if r["bytes"] or kind == "latency") and all(r["wrong"] == 0 for r in rows)


def test_osu_columns_for_a_collective(tmp_path):
    out = tmp_path / "o.json"
    p = run_mpi(3, ["-m", "pympar.bench", "allreduce", "-b", "64", "-e", "64", "--format", "osu", "-n", "5", "-w", "1",
                    "--algo", "auto,library", "--json", out], timeout=60)
    assert "Avg Latency(us)" in p.stdout and "Max Latency(us)" in p.stdout and "auto(" in p.stdout, p.stdout
    for r in json.loads(out.read_text())["rows"]:
        assert 0 < r["min_us"] <= r["avg_us"] <= r["time_us"]


def test_context_parallel_bench_runs_and_its_ranks_agree(tmp_path):
    """bench/context_parallel.py --quick (T = 512, cp 1, 2, 4): every row ran, the cp ranks' losses
    are the one-process run's, and each rank of cp = 4 holds a quarter of cp = 1's activations."""
    out = tmp_path / "cp.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "context_parallel.py"), "--quick", "--timeout", "200",
                        "--json", out, "--png", tmp_path / "cp.png"],
                       capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4                               # cp = 1 on the node's cores and on one, cp = 2, cp = 4
    by = {r["cp"]: r for r in rows if r["threads"] != 1 or r["cp"] > 1}
    assert set(by) == {1, 2, 4}
    for cp in (2, 4):
        assert by[cp]["losses"] == pytest.approx(by[1]["losses"], rel=1e-4)
    assert by[4]["activations"] <= 0.3 * by[1]["activations"]


def test_ddp_step_compares_the_same_work(tmp_path, bench_module):
    """bench/ddp_step.py: both sides run, agree on the loss at steps 0 and 1, and the doc renders the row."""
    pytest.importorskip("torch")
    res = tmp_path / "results"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "ddp_step.py"), "--presets", "tiny", "--world", "2",
                        "--global-batch", "4", "--rounds", "1", "--steps", "2", "--warmup", "1", "--timeout", "90",
                        "--json", res / "ddp_step.json", "--png", tmp_path / "ddp_step.png"],
                       capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads((res / "ddp_step.json").read_text())
    (r,) = d["rows"]
    assert (r["preset"], r["world"], r["per_rank_batch"], r["global_batch"]) == ("tiny", 2, 2, 4)
    assert r["params"] == r["torch_params"] and r["same_loss"]
    # the same weights and batch give the same loss; one synchronised AdamW step later still the same
    assert r["loss0_pympar"] == pytest.approx(r["loss0_torch"], rel=1e-5)
    assert r["loss1_pympar"] == pytest.approx(r["loss1_torch"], rel=1e-4) and r["loss1_torch"] != r["loss0_torch"]
    assert r["pympar_tokens_per_s"] > 0 and r["torch_tokens_per_s"] > 0
    assert r["ratio"] == pytest.approx(r["torch_step_s"] / r["pympar_step_s"])
    report_md = bench_module("report_md")
    doc = report_md.render(res, {})
    assert "pympar DP vs torch DDP" in doc and f"| tiny | 2 | 2 x 64 | {r['pympar_tokens_per_s']:.0f} |" in doc


def test_memory_bench_measures_from_outside_and_renders(tmp_path, bench_module):
    """bench/memory.py --quick: every row's ranks measured by /usr/bin/time (one peak per rank),
    beside rank 0's ledger and the planner's prediction; the doc renders the table."""
    res = tmp_path / "results"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "memory.py"), "--quick", "--json", res / "memory.json",
                        "--png", tmp_path / "memory.png"], capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads((res / "memory.json").read_text())
    assert len(d["rows"]) == 3 and d["baseline_bytes"] > 10 * 2**20
    for r in d["rows"]:
        assert len(r["measured_per_rank"]) == r["world"] and r["measured_peak"] == max(r["measured_per_rank"])
        assert r["measured_peak"] > r["baseline"] and r["ledger_rank0"]["peak"] > 0
        assert 0.7 < r["ratio_predicted_to_measured"] < 1.3         # the tiny model: the baseline dominates
    report_md = bench_module("report_md")
    doc = report_md.render(res, {})
    assert "## Memory per rank" in doc and "| quick | 2 | dp2 pp1 tp1 | 3 | full |" in doc


def test_train_step_bench_runs_the_pytorch_peers(tmp_path, bench_module):
    """bench/train_step.py: pympar beside PyTorch eager + SDPA and the naive-attention peer (the
    torch.compile peer is the same code path and too slow to compile here), the MFU column and
    the table row; the doc renders it."""
    pytest.importorskip("torch")
    res = tmp_path / "results"
    res.mkdir()
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "train_step.py"), "--preset", "tiny", "--set", "n_embd=64",
                        "--batch", "2", "--steps", "1", "--warmup", "0", "--peers", "sdpa,naive", "--profile", "0",
                        "--json", res / "train_step.json"], capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads((res / "train_step.json").read_text())
    assert d["shape"] == "L2 D64 H2 V256 T64 B2" and d["config"]["n_embd"] == 64
    for peer in ("sdpa", "naive"):
        assert d[f"{peer}_speed_ratio"] == pytest.approx(d["repeats"][0][f"{peer}_step_s"] / d["repeats"][0]["pympar_step_s"])
        assert 0 < d[f"{peer}_mfu_vs_sgemm"] and d["pympar_mfu_vs_sgemm"] > 0 and d["sgemm_gflops"] > 0
    assert "compile_step_s" not in d and list(d["table"]) == ["L2 D64 H2 V256 T64 B2/1"]
    report_md = bench_module("report_md")
    doc = report_md.render(res, {})
    assert "| L2 D64 H2 V256 T64 B2 | 1 |" in doc and "torch.compile" in doc


def test_attention_bench_quick(tmp_path, bench_module):
    """bench/attention.py --quick: the three implementations timed, the memory columns measured (one of
    them a single model, block_size the longest T, at every T)."""
    pytest.importorskip("torch")
    res = tmp_path / "results"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "attention.py"), "--quick", "--json", res / "attention.json",
                        "--png", tmp_path / "attention.png"], capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads((res / "attention.json").read_text())
    assert [r["T"] for r in d["speed"]] == [256] and all(d["speed"][0][f"{k}_s"] > 0 for k in ("tiled", "materialized", "sdpa"))
    assert [r["T"] for r in d["memory"]] == [128, 256] and d["memory"][0]["tiled_peak_bytes"] > 10 * 2**20
    # the one-model column: at the longest T it is the same program as the tiled column (block_size = T there)
    last = d["memory"][-1]
    assert abs(last["tiled_one_model_peak_bytes"] / last["tiled_peak_bytes"] - 1) < 0.1, last
    assert d["tiled_one_model_peak_growth"] > 0
    assert (tmp_path / "attention.png").stat().st_size > 1000
    report_md = bench_module("report_md")
    md = report_md.render(res, {})
    assert "## Causal attention" in md and "tiled, one model MiB" in md


def test_verb_descriptions_bus_factors_and_algorithms():
    """pympar.comm.verbs: nccl-tests' bus factors (allreduce 2(n-1)/n; reduce_scatter, allgather,
    alltoall (n-1)/n; broadcast 1), the bench's table is the verbs' own, and every nonblocking
    algorithm is one of the verb's blocking ones."""
    from pympar.bench.runners import BUSBW, IN_PLACE
    from pympar.comm.verbs import ALGOS, VERBS

    assert VERBS["allreduce"].bus_factor(8) == 1.75 and VERBS["broadcast"].bus_factor(8) == 1.0
    assert all(VERBS[v].bus_factor(4) == 0.75 for v in ("reduce_scatter", "allgather", "alltoall", "alltoallv"))
    assert all(BUSBW[v] is VERBS[v].bus_factor for v in VERBS) and BUSBW["sendrecv"](8) == 1.0
    assert IN_PLACE == {"allreduce", "broadcast"}
    assert {v for v, d in VERBS.items() if d.reducing} == {"allreduce", "reduce_scatter"}
    assert all(set(VERBS[v].nonblocking) <= set(VERBS[v].algorithms) for v in VERBS)
    assert set(ALGOS) == set(VERBS) - {"alltoallv"}


def test_no_bench_script_is_named_like_a_package_transformers_probes():
    """A script run as `python bench/x.py` has bench/ first on sys.path: a script named like an optional
    package (transformers asks is_kernels_available() and then imports `kernels`) is imported in its
    place. Each is_<name>_available of transformers names such a package."""
    iu = pytest.importorskip("transformers.utils.import_utils")
    probed = {n[3:-len("_available")] for n in dir(iu) if n.startswith("is_") and n.endswith("_available")}
    assert "kernels" in probed and "torch" in probed      # the probe list is what this test reads
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert not scripts & probed, f"bench/ scripts named like packages transformers imports: {sorted(scripts & probed)}"


def test_pipeline_head_bench_times_both_paths(tmp_path, bench_module):
    """bench/pipeline_head.py: the last stage's head in one pass and apart, same loss, a ratio per pair;
    docs/benchmarks.md's section renders it."""
    out = tmp_path / "pipeline_head.json"
    run_mpi(2, ["bench/pipeline_head.py", "--layers", "2", "--embd", "32", "--vocab", "256", "--seq", "1100",
                "--micro", "2", "--pairs", "1", "--json", out], timeout=180, cwd=ROOT)
    d = json.loads(out.read_text())
    assert d["fuses"] and d["same_loss"] and d["shape"] == "pp2 L2 C32 V256 T1100 m2"
    assert d["threads"] == 1                           # the bench environment: one thread per rank
    assert d["ratio"] == pytest.approx(d["apart_s"] / d["one_pass_s"]) and len(d["pair_ratios"]) == 1
    md = bench_module("report_md").sec_pipeline_head(tmp_path, {})
    assert "| pp2 L2 C32 V256 T1100 m2 |" in md and f"{d['ratio']:.2f}x" in md


def test_gemm_bench_times_both_blas_on_the_step_products(tmp_path, bench_module):
    """bench/gemm.py: every product of a step (4 Linears x 3 per layer, the head's 3) timed on NumPy's
    BLAS, pympar's products and PyTorch's BLAS, the step's totals the count-weighted sums of the
    products; the doc's table renders the row."""
    pytest.importorskip("torch")
    res = tmp_path / "gemm.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gemm.py"), "--threads", "1", "--reps", "1",
                        "--shapes", "2:64:128:96", "--json", res, "--png", tmp_path / "gemm.png"],
                       capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(res.read_text())
    (row,) = d["rows"]
    assert row["threads"] == 1 and len(row["products"]) == 15
    assert {tuple(q["shape"]) for q in row["products"]} >= {(128, 64, 192), (128, 256, 64), (64, 128, 256), (128, 64, 96)}
    flops = sum(q["count"] * 2 * q["shape"][0] * q["shape"][1] * q["shape"][2] for q in row["products"])
    assert flops == 6 * 128 * (2 * 12 * 64 * 64 + 96 * 64)          # 6 x tokens x (Linear + head weights)
    ms = sum(q["count"] * 2e-6 * q["shape"][0] * q["shape"][1] * q["shape"][2] / q["numpy_gflops"] for q in row["products"])
    assert abs(ms / row["numpy_ms"] - 1) < 1e-9 and row["torch_over_numpy"] > 0
    ms = sum(q["count"] * 2e-6 * q["shape"][0] * q["shape"][1] * q["shape"][2] / q["pympar_gflops"] for q in row["products"])
    assert abs(ms / row["pympar_ms"] - 1) < 1e-9 and row["torch_over_pympar"] == pytest.approx(row["pympar_ms"] / row["torch_ms"])
    assert d["pympar_gemm"].startswith(("MKL", "NumPy"))
    assert (tmp_path / "gemm.png").stat().st_size > 1000
    md = bench_module("report_md").sec_gemm(tmp_path, {})
    assert f"| {row['shape']} | 1 | {row['numpy_ms']:.1f} | {row['pympar_ms']:.1f} | {row['torch_ms']:.1f} |" in md


def test_the_targets_table_says_met_and_missed_from_the_json(tmp_path, bench_module):
    """docs/benchmarks.md opens with every target a benchmark JSON records: a figure within its
    bound is met, one beyond it is missed by the ratio, a ledger's account of itself is not counted as
    a measurement, and auto's points are counted."""
    res = tmp_path / "results"
    res.mkdir()
    (res / "checkpoint.json").write_text(json.dumps({"targets": {"stall / save (target <= 0.2)": 0.3}}))
    (res / "memory.json").write_text(json.dumps({"targets": {
        "a: zero3 / dp1 (peak RSS, target <= 0.4)": 0.38, "a: act none / full (ledger, target >= 4)": 2.0,
        "a: dp4 zero1 model state / ideal (target <= 1.05; transients apart: 0 MiB)": 1.0}}))
    (res / "auto_select.json").write_text(json.dumps({"target": 1.15, "summary": [
        {"auto_over_best": 1.0}, {"auto_over_best": 1.5}]}))
    rows = {r[0]: r for r in bench_module("report_md").target_rows(res)}
    assert rows["stall / save"][1:3] == ("<= 0.2", "0.300") and rows["stall / save"][4] == "**missed** by 1.50x"
    assert rows["a: zero3 / dp1 (peak RSS)"][4] == "met"
    assert rows["a: act none / full (ledger)"][4] == "**missed**: 0.50 of it"
    assert rows["a: dp4 zero1 model state / ideal"][4].startswith("not a measurement")
    auto = next(r for k, r in rows.items() if k.startswith('algo="auto"'))
    assert auto[2] == "1 of 2 (worst 1.50x)" and auto[4] == "**missed** at 1 points"
    for name in ("auto_select", "memory"):               # (their own sections want a whole run's rows)
        (res / f"{name}.json").unlink()
    assert "| stall / save | <= 0.2 | 0.300 |" in bench_module("report_md").render(res, {})


def test_reproducible_bench_measures_both_paths_and_renders(tmp_path, bench_module):
    """bench/reproducible.py --quick: the reproducible allreduce beside auto and the library per size
    on 2 ranks, and the trainer with and without --deterministic; the doc renders the table."""
    res = tmp_path / "results"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "reproducible.py"), "--quick", "--json",
                        res / "reproducible.json"], capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads((res / "reproducible.json").read_text())
    assert [(r["ranks"], r["bytes"]) for r in d["collectives"]] == [(2, 4096), (2, 1 << 20)]
    for r in d["collectives"]:
        assert min(r["library_us"], r["auto_us"], r["reproducible_us"]) > 0
        assert r["reproducible_over_auto"] == pytest.approx(r["reproducible_us"] / r["auto_us"])
    t = d["trainer"]
    assert t["default_tokens_per_s"] > 0 and t["deterministic_tokens_per_s"] > 0
    doc = bench_module("report_md").render(res, {})
    assert "## Reproducible sums: their cost" in doc and "| 2 | 4 KiB |" in doc


def test_param_server_bench_runs_both_and_renders(tmp_path, bench_module):
    """bench/param_server.py --quick: 2 workers and 1 server against the workers' allreduce, one job."""
    res = tmp_path / "results"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "param_server.py"), "--quick", "--json",
                        res / "param_server.json"], capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (r,) = json.loads((res / "param_server.json").read_text())["rows"]
    assert (r["workers"], r["servers"], r["bytes"], r["transport"]) == (2, 1, 1 << 20, "shm")
    assert r["ps_ms"] > 0 and r["allreduce_ms"] > 0 and r["same_update"]      # both computed the same update
    assert r["ps_over_allreduce"] == pytest.approx(r["ps_ms"] / r["allreduce_ms"])
    assert "## The seed's parameter-server comparison" in bench_module("report_md").render(res, {})


def test_cp_comm_bench_measures_the_closed_forms(tmp_path, bench_module):
    """bench/cp_comm.py --quick (cp 2, T 512): the bytes each rank sends are the closed forms exactly
    (ring 6u on rank 0, whose partial covers the other block's keys whole, and 5u on rank 1, whose
    covers half; Ulysses 4u on both); the doc renders the table."""
    res = tmp_path / "results"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "cp_comm.py"), "--quick", "--json", res / "cp_comm.json"],
                       capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((res / "cp_comm.json").read_text())["rows"]
    assert [(r["comm"], r["cp"], r["T"]) for r in rows] == [("ring", 2, 512), ("a2a", 2, 512)]
    for r in rows:
        assert r["bytes_per_rank"] == r["closed_form_units"] * r["unit_bytes"], r
        assert r["bytes_min_rank"] == r["closed_form_min_units"] * r["unit_bytes"], r
        assert (r["closed_form_units"], r["closed_form_min_units"]) == {"ring": (6, 5), "a2a": (4, 4)}[r["comm"]]
        assert r["seconds"] > 0
    assert "## Context parallelism's attention: the ring against Ulysses" in bench_module("report_md").render(res, {})


def test_cp_comm_two_nodes_counts_the_bytes_across_nodes(tmp_path, bench_module):
    """bench/cp_comm.py --two-nodes (cp 4 = 2 nodes x 2, T 512, one round): on both transports the bytes
    each variant sends across the nodes per rank are its closed form, in u (this rank's share of one
    activation): Ulysses 4u (2 of its 3 peers' blocks of 6u); the ring 9u (its key/value hops, 2 of 4
    ranks' 12u, and of the partials to the blocks' owners 4u, 4u, 2u and 2u from ranks 0-3: 36u over
    4 ranks); a2a+ring 5.5u (the ring of the 2 nodes, every byte across: 6u and 5u; Ulysses stays
    inside a node)."""
    res = tmp_path / "cp_hybrid.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "cp_comm.py"), "--two-nodes", "--T", "512", "--rounds",
                        "1", "--json", res], capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(res.read_text())["rows"]
    assert [(r["transport"][:7], r["comm"]) for r in rows] == \
        [(t, c) for t in ("shared ", "network") for c in ("ring", "a2a", "a2a+ring")]
    for r in rows:
        across_u = r["bytes_across_nodes"] / (4 * r["unit_bytes"])
        assert across_u == {"ring": 9, "a2a": 4, "a2a+ring": 5.5}[r["comm"]], r
        assert r["seconds"] > 0 and r["speedup_vs_best_pure"] > 0
    assert "## Context parallelism on two simulated nodes" in bench_module("report_md").sec_cp_hybrid(tmp_path, {})


def test_moe_fold_bench_measures_every_grid_from_outside(tmp_path, bench_module):
    """bench/moe_fold.py --quick: 4 ranks as tp 2 x dp 2 with the experts on three grids (ep 1, ep 2,
    ep 4 etp 1 folded): every rank's peak measured, the same losses as one process, the folded
    grid holding a quarter of the experts whole; the report's section renders."""
    res = tmp_path / "moe_fold.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_fold.py"), "--quick", "--steps", "3", "--json", res,
                        "--png", tmp_path / "f.png"], capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(res.read_text())
    rows = {r["label"]: r for r in d["rows"]}
    assert list(rows) == ["ep 1", "ep 2", "ep 4, etp 1 (folded)"]
    for r in rows.values():
        assert len(r["peaks"]) == 4 and min(r["peaks"]) > 0 and r["max_rel_loss_diff"] < 1e-5, r
    n = {k: r["expert_params_per_rank"] for k, r in rows.items()}     # the same share of the weights (the
    assert abs(n["ep 4, etp 1 (folded)"] / n["ep 2"] - 1) < 0.01          # split experts repeat c_proj's bias)
    assert n["ep 1"] == 2 * n["ep 2"]
    assert "## Experts folded apart from tensor parallelism" in bench_module("report_md").sec_moe_fold(tmp_path, {})


def test_call_overhead_bench_times_every_row_and_renders(tmp_path, bench_module):
    """bench/call_overhead.py at 2 ranks, shared memory, a few rounds: the three rows at every size,
    the ratios their quotients, the choices named; the doc's section and the targets table render."""
    res = tmp_path / "results"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "call_overhead.py"), "--ranks", "2", "--transports", "shm",
                        "--rounds", "2", "--calls", "50", "--json", res / "call_overhead.json", "--png",
                        tmp_path / "co.png"], capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((res / "call_overhead.json").read_text())["rows"]
    assert [r["bytes"] for r in rows] == [8, 4096, 65536]
    for r in rows:
        assert set(r["us"]) == {"library", "abort", "raise"} and min(r["us"].values()) > 0, r
        for mode in ("abort", "raise"):
            assert r["ratio"][mode] == pytest.approx(r["us"][mode] / r["us"]["library"])
        assert r["chosen"]["raise"] != "blocking", r        # the raising communicator never blocks in MPI
    md = bench_module("report_md").render(res, {})
    assert "## Per-call cost: MPIComm against the library called through mpi4py" in md
    assert "MPIComm(world).allreduce per call / mpi4py's Allreduce at 8 B and 4 KiB" in md


def test_cp_weak_bench_runs_every_configuration(tmp_path, bench_module):
    """bench/cp_weak.py with one short length: one rank on L and cp = 2 (ring, a2a) on 2L train, the
    efficiency is the quotient of their step times and the ceiling 1/(1 + attention's FLOP share)."""
    res = tmp_path / "cp_weak.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "cp_weak.py"), "--per-rank", "64", "--rounds", "1",
                        "--steps", "3", "--json", res, "--png", tmp_path / "w.png"], capture_output=True, text=True,
                       env=mpi_env(), cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(res.read_text())["rows"]
    assert [(r["per_rank"], r["cp"], r["comm"]) for r in rows] == [(64, 2, "ring"), (64, 2, "a2a")]
    for r in rows:
        assert r["efficiency"] == pytest.approx(r["one_rank_s"] / r["cp_s"])
        assert 0 < r["attention_share"] < 1 and r["ceiling"] == pytest.approx(1 / (1 + r["attention_share"]))
        runs = r["runs_s"]                        # one round: its efficiency is the rows' (the fastest runs)
        assert r["efficiency_rounds"] == [pytest.approx(runs["1-ring"][0] / runs[f"2-{r['comm']}"][0])]
        assert r["efficiency_median_round"] == pytest.approx(r["efficiency"])


def test_moe_experts_bench_times_both_ways_and_reports(tmp_path, bench_module):
    """bench/moe_experts.py at one size: both ways timed on the same uneven rows (the grouped call
    really ran: the script checks the ctx), the speed-up their quotient, the report's section."""
    res = tmp_path / "moe_experts.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_experts.py"), "--experts", "8", "--threads", "1",
                        "--rows", "256", "--dtypes", "float32", "--reps", "1", "--rounds", "1", "--json", res,
                        "--png", tmp_path / "m.png"],
                       capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(res.read_text())
    [r] = d["rows"]
    assert sum(r["counts"]) == 256 and len(r["counts"]) == 8 and r["max_over_mean"] > 1.5   # uneven
    assert r["speedup"] == pytest.approx(r["loop_ms"] / r["grouped_ms"])
    report = bench_module("report_md")
    md = report.sec_moe_experts(tmp_path, {})
    assert "## Grouped expert products" in md and f"{r['speedup']:.2f}x" in md


def test_moe_dispatch_bench_measures_both_exchanges(tmp_path, bench_module):
    """bench/moe_dispatch.py --quick: 2 nodes x 2 ranks on both transports, top-2 and 4; the worker
    checks that both exchanges give the same y; the bytes across nodes fall with top-k (the route
    sends a token to a node once) and the speed-up is the quotient of the two times."""
    res = tmp_path / "moe_dispatch.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_dispatch.py"), "--quick", "--json", res,
                        "--png", tmp_path / "d.png"], capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(res.read_text())
    assert [(r["transport"], r["nodes"], r["ranks_per_node"], r["top_k"]) for r in d["rows"]] == \
        [(t, 2, 2, k) for t in ("shm", "network") for k in (2, 4)]
    for r in d["rows"]:
        assert 0 < r["bytes_ratio"] < 1 and r["speedup"] == pytest.approx(r["flat_s"] / r["node_s"])
    by_k = {r["top_k"]: r["bytes_ratio"] for r in d["rows"] if r["transport"] == "shm"}
    assert by_k[4] < by_k[2]
    md = bench_module("report_md").sec_moe_dispatch(tmp_path, {})
    assert "## Expert dispatch: flat alltoallv against the node-aware route" in md


def test_moe_replicas_bench_runs_with_and_without(tmp_path, bench_module):
    """bench/moe_replicas.py --quick: ep 2 without replicas and with one slot per rank, the same
    losses to float32 rounding, the rows per rank evened out, the report's section."""
    res = tmp_path / "moe_replicas.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_replicas.py"), "--quick", "--json", res,
                        "--png", tmp_path / "r.png"], capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    [g] = json.loads(res.read_text())["runs"]
    base, rep = g["rows"]
    assert (base["slots"], rep["slots"]) == (0, 1)
    assert sum(len(c) - 1 for c in rep["copies"][0]) == g["ep"]          # one replica per rank, every layer
    assert rep["loss_rel_diff"] < 1e-5 and rep["rank_max_over_mean"] < base["rank_max_over_mean"]
    md = bench_module("report_md").sec_moe_replicas(tmp_path, {})
    assert "## Replicated hot experts" in md


def test_dualpipe_ep_bench_times_the_three_variants_and_renders(tmp_path, bench_module):
    """bench/dualpipe_ep.py --quick: the 2-rank transfer check, then 1f1b, dualpipev off and on with
    the model's compute and emulated, one launch each; the pairs ran only where asked, the two
    dualpipev variants trained bitwise alike (the script checks, exit 0), the section and its two
    targets render."""
    res = tmp_path / "results"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "dualpipe_ep.py"), "--quick", "--json",
                        res / "dualpipe_ep.json", "--png", tmp_path / "d.png"],
                       capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads((res / "dualpipe_ep.json").read_text())
    assert [t["mb"] for t in d["transfer"]] == [1.0, 8.0] and all(t["blocking"] > 0 for t in d["transfer"])
    assert [r["work"] for r in d["rows"]] == ["model", "sleep"]
    for r in d["rows"]:
        pairs = [run["pairs"] for v in r["variants"] for run in v["runs"]]
        assert pairs[:2] == [0, 0] and pairs[2] > 0, pairs
        assert all(v["exposed_a2a_s"] > 0 and v["step_s"] > 0 for v in r["variants"])
    assert len(d["targets"]) == 1 and (tmp_path / "d.png").stat().st_size > 0
    doc = bench_module("report_md").render(res, {})
    assert "## DualPipeV's overlap of the expert-parallel all-to-all" in doc and "| sleep | shared memory |" in doc
    assert "DualPipeV --pp-overlap on: share of 1F1B's exposed EP all-to-all time hidden" in doc


def test_smoke_runs_write_beside_the_cited_results(bench_module):
    """--quick (a bench script's or run_all's) writes its JSON, PNG and doc under bench/results/quick/
    (ignored by git), never over bench/results/NAME.json or docs/img/ that the docs cite; without
    --quick the defaults are those, and an explicit --json wins."""
    common, run_all = bench_module("common"), bench_module("run_all")
    quick = ROOT / "bench" / "results" / "quick"
    for argv, want in ((["--quick"], (quick / "x.json", quick / "img" / "x.png")),
                       ([], (ROOT / "bench" / "results" / "x.json", ROOT / "docs" / "img" / "x.png"))):
        ap = common.worker_parser("x")
        common.add_output_args(ap, "x")
        a = common.resolve_outputs(ap.parse_args(argv))
        assert (a.json, a.png) == tuple(map(str, want))
    ap = common.worker_parser("x")
    common.add_output_args(ap, "x")
    assert common.resolve_outputs(ap.parse_args(["--quick", "--json", "/tmp/y.json"])).json == "/tmp/y.json"
    assert run_all.dirs(True) == (quick, quick / "img")
    for name, cmd, fig in run_all.steps(True):          # every step's explicit paths are the smoke run's
        paths = [str(x) for c in (cmd if isinstance(cmd[0], list) else [cmd]) for x in c + (fig or [])
                 if str(x).endswith((".json", ".png"))] + [str(x) for c in (cmd if isinstance(cmd[0], list) else [cmd])
                                                           for i, x in enumerate(c) if c[i - 1] == "--png-dir"]
        assert paths and all(p.startswith(str(quick)) for p in paths), (name, paths)
    assert "/bench/results/quick/" in (ROOT / ".gitignore").read_text().split()
    for script in (ROOT / "bench").glob("*.py"):   # --json/--png are None until resolved: every user resolves
        text = script.read_text()
        if "add_output_args(" in text and script.name != "common.py":
            assert "resolve_outputs(ap.parse_args(" in text, script.name


def test_bad_values_are_one_line_errors_before_anything_runs(tmp_path):
    """Sizes, counts, dtype, --op, output files: one "error:" line and status 2 before any
    communicator is made (they were tracebacks, nonsense rows, or a replaced file)."""
    summary = tmp_path / "summary.json"
    summary.write_text('{"steps": 1}')
    cases = {("allreduce", "-b", "-8"): "need 0 <= minbytes <= maxbytes",
             ("allreduce", "-e", "1X"): "sizes are bytes with an optional K, M or G",
             ("allreduce", "-e", "999999G"): "needs about 4x that per rank",
             ("allreduce", "-n", "0"): "--iters=0 must be >= 1",
             ("bw", "--window", "0"): "--window=0 must be >= 1",
             ("allgather", "--op", "max"): "--op applies to allreduce and reduce_scatter",
             ("allreduce", "--dtype", "float8"): "--dtype 'float8'",
             ("allreduce", "--json", str(tmp_path)): "is a directory",
             ("allreduce", "-f", "inf"): "--stepfactor=inf must be a finite number > 1",
             ("allreduce", "--tune", str(summary)): "is not a pympar tuning file; it would be replaced"}
    for args, want in cases.items():
        r = subprocess.run([sys.executable, "-m", "pympar.bench", *args], capture_output=True, text=True,
                           env=mpi_env(), cwd=ROOT, timeout=60)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-500:])
    assert summary.read_text() == '{"steps": 1}'


def test_library_rows_call_the_librarys_own_collective():
    """The library row of alltoall is MPI_Alltoall and of alltoallv MPI_Alltoallv (with equal counts the
    bytes are the same either way, so only the call made tells them apart)."""
    from types import SimpleNamespace

    from pympar.bench.cli import library_call

    class Recording:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *a, **k: self.calls.append(name)
    for coll, want in (("alltoall", "Alltoall"), ("alltoallv", "Alltoallv")):
        mc = Recording()
        case = SimpleNamespace(comm=SimpleNamespace(mpi_comm=mc, size=2, rank=0), x=np.zeros(8, np.float32),
                               out=np.zeros(8, np.float32))
        library_call(coll, "sum")(case)
        assert mc.calls == [want], (coll, mc.calls)
