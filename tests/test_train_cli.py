"""python -m pympar.train end to end under mpiexec, plus its configuration parsing in-process."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from mpirun import run_mpi
from pympar import layout as layouts
from pympar.config import ConfigError, apply_environment, parse_args
from pympar.parallel import ledger

TINY = ["--preset", "tiny", "--block-size", "16", "--micro-batch-size", "2", "--sample-tokens", "8",
        "--eval-iters", "2"]
KEYS = {"step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "time_split", "loss_scale", "moe"}


def train(n, *args, check=True, timeout=90, cache=None, address_space=None):
    env = {"PYMPAR_CACHE": cache} if cache else None
    return run_mpi(n, ["-m", "pympar.train", *TINY, *map(str, args)], timeout=timeout, check=check, env=env,
                   address_space=address_space)


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def error_lines(res):
    return [line for line in res.stdout.splitlines() if line.startswith("pympar.train: error:")]


def test_help_lists_every_option_with_defaults():
    res = run_mpi(1, ["-m", "pympar.train", "--help"], timeout=60)
    for flag in ("--preset", "--dp", "--pp", "--tp", "--ep", "--schedule", "--micro-batch-size", "--n-micro",
                 "--zero", "--seq-parallel", "--compress", "--device", "--dtype", "--steps", "--lr", "--seed",
                 "--out", "--profile", "--config", "--data", "--n-expert", "--capacity-factor", "--comm-timeout"):
        assert flag in res.stdout, flag
    assert "(default: 200)" in res.stdout and "(default: tiny)" in res.stdout


@pytest.mark.parametrize("n", [1, 2, 4])
def test_default_run_on_n_ranks(tmp_path, n):
    out = tmp_path / "run"
    res = train(n, "--steps", 3, "--eval-every", 2, "--out", out)
    assert f"layout dp={n} pp=1 tp=1 ep=1 (chosen for the world size)" in res.stdout
    assert "python3" in res.stdout and "stdlib" in res.stdout          # the default corpus
    assert res.stdout.count("--- sample (top-k) ---") == 1               # rank 0 only
    m = metrics(out)
    assert [r["step"] for r in m] == [0, 1, 2]
    assert KEYS <= set(m[0])
    assert m[0]["val_loss"] is None and m[1]["val_loss"] is not None and m[2]["val_loss"] is not None
    assert all(np.isfinite(r["loss"]) and 4.0 < r["loss"] < 7.0 for r in m)   # ~ln(256)=5.55 at init
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in m)
    assert (m[1]["time_split"]["dp_comm"] > 0) == (n > 1)
    s = json.loads((out / "summary.json").read_text())
    assert s["ranks"] == n and s["config"]["parallel"]["dp"] == n


def test_data_parallel_matches_gradient_accumulation(tmp_path):
    """The central claim: 2 ranks x 2 micro-batches == 1 rank x 4 micro-batches, step by step."""
    train(1, "--steps", 3, "--n-micro", 4, "--out", tmp_path / "a")
    train(2, "--steps", 3, "--n-micro", 2, "--out", tmp_path / "b")
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in a], [r["grad_norm"] for r in b], rtol=1e-4)
    assert a[2]["loss"] != a[0]["loss"]                                  # it did train


def test_moe_run_reports_expert_load(tmp_path):
    train(2, "--preset", "moe-tiny", "--block-size", "16", "--steps", 2, "--out", tmp_path)
    m = metrics(tmp_path)
    layers = m[-1]["moe"]
    assert [s["layer"] for s in layers] == [0, 1]
    for s in layers:
        # top_k=2 assignments of every token of the global batch (2 ranks x 2 x 16 tokens)
        assert sum(s["tokens_per_expert"]) == 2 * 2 * 2 * 16 and len(s["tokens_per_expert"]) == 4
        assert s["load_cv"] >= 0 and s["max_over_mean"] >= 1 and s["dropped_fraction"] == 0


def test_profile_trace_has_a_row_per_rank_and_report_draws_it(tmp_path):
    train(2, "--steps", 3, "--profile", "--out", tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    ev = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert sorted(names) == [0, 1] and names[1].startswith("rank 1")
    for r in (0, 1):
        mine = [e for e in ev if e["pid"] == r and e["ph"] == "X"]
        cats = {e["cat"] for e in mine}
        assert {"compute", "dp_comm", "optimizer", "step", "layer"} <= cats
        assert any(e["name"] == "fwd h.1" for e in mine) and any(e["name"] == "bwd embedding" for e in mine)
        assert all(e["dur"] >= 0 for e in mine)
    assert all(e["args"]["bytes"] > 0 for e in ev if e.get("cat") == "dp_comm")
    res = run_mpi(1, ["-m", "pympar.report", tmp_path], timeout=60)
    pp = tmp_path / "pp"                         # a pipeline's trace: one event per executed action
    train(2, "--steps", 2, "--pp", 2, "--schedule", "zb-h1", "--n-micro", 2, "--profile", "--out", pp)
    ev = json.loads((pp / "trace.json").read_text())["traceEvents"]
    for r in (0, 1):
        acts = sorted((e["name"], e["args"]["mb"]) for e in ev if e["pid"] == r and e.get("cat") == "layer")
        assert acts == sorted([(f"{k} stage {r}", mb) for k in ("fwd", "bwd", "wgrad") for mb in (0, 1)] * 2), acts
    for png in ("loss.png", "throughput.png", "time_split.png", "pipeline.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
    assert "experts.png" not in res.stdout


def test_config_file_with_flag_override(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('steps = 5\nlr = 0.002\n[model]\nn_layer = 3\nn_embd = 16\n')
    train(1, "--config", cfg, "--steps", 2, "--out", tmp_path / "o")
    s = json.loads((tmp_path / "o" / "summary.json").read_text())["config"]
    assert s["run"]["steps"] == 2 and s["optim"]["lr"] == 0.002          # flag beats file; file beats default
    assert s["model"]["n_layer"] == 3 and s["model"]["n_embd"] == 16
    assert len(metrics(tmp_path / "o")) == 2


# ----------------------------------------------------------------------------- data formats

def _llmc(path, tokens):
    header = np.zeros(256, np.int32)
    header[:3] = (20240520, 1, len(tokens))
    path.write_bytes(header.tobytes() + np.asarray(tokens, np.uint16).tobytes())


def test_every_data_format_trains(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    tdir = tmp_path / "texts"
    tdir.mkdir()
    for i in range(12):
        (tdir / f"{i}.md").write_text(f"# note {i}\n" + "some words here " * 20)
    nano = tmp_path / "nano"
    nano.mkdir()
    rng = np.random.default_rng(0)
    (nano / "train.bin").write_bytes(rng.integers(0, 300, 2000).astype(np.uint16).tobytes())
    (nano / "val.bin").write_bytes(rng.integers(0, 300, 400).astype(np.uint16).tobytes())
    _llmc(tmp_path / "tok_train.bin", rng.integers(0, 500, 3000))
    _llmc(tmp_path / "tok_val.bin", rng.integers(0, 500, 500))
    for spec, vocab in ((text, 256), (tdir, 256), (nano, None), (tmp_path / "tok_train.bin", None)):
        out = tmp_path / f"o_{spec.name}"
        res = train(2, "--data", spec, "--steps", 2, "--out", out, cache=tmp_path / "cache")
        assert str(spec) in res.stdout
        s = json.loads((out / "summary.json").read_text())
        want = vocab or 1 + max(int(np.fromfile(p, np.uint16, offset=o).max()) for p, o in (
            ((nano / "train.bin", 0), (nano / "val.bin", 0)) if spec == nano else
            ((tmp_path / "tok_train.bin", 1024), (tmp_path / "tok_val.bin", 1024))))
        assert s["config"]["model"]["vocab_size"] == want
        assert all(np.isfinite(r["loss"]) for r in metrics(out))


@pytest.mark.parametrize("case", ["empty", "binary", "magic", "short", "missing"])
def test_bad_data_fails_every_rank_naming_the_file(tmp_path, case):
    bad = tmp_path / ("bad.bin" if case in ("magic", "short") else "bad.txt")
    if case == "empty":
        bad.write_bytes(b"")
    elif case == "binary":
        bad.write_bytes(b"\x00\x01\x02" * 100)
    elif case == "magic":
        bad.write_bytes(np.zeros(300, np.int32).tobytes())
    elif case == "short":
        _llmc(bad, range(100))
        bad.write_bytes(bad.read_bytes()[:-50])
    res = train(2, "--data", bad, "--steps", 2, check=False, timeout=60)
    assert res.returncode != 0
    lines = error_lines(res)
    assert len(lines) == 2 and lines[0] == lines[1], res.stdout[-2000:]   # every rank, same line
    assert str(bad) in lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--dp", "3"], "does not match the world size 2"),
    (["--seq-parallel"], "--seq-parallel splits activations over the tensor-parallel group"),
    (["--n-head", "3"], "n_embd=32 is not divisible by n_head=3"),
    (["--schedule", "zigzag"], "invalid choice"),
    (["--steps", "0"], "steps=0 must be >= 1"),
    (["--block-size", "100000", "--data", "__SMALL__"], "fewer than block_size+1"),
    (["--cp", "2", "--block-size", "30"], "cp=2 needs a sequence length divisible by 2*cp = 4"),
    (["--cp", "2", "--cp-comm", "a2a", "--n-head", "1"], "--cp-comm a2a gives each of the cp=2 ranks"),
    (["--lr", "nan"], "lr=nan must be a finite number"),
    (["--grad-clip", "inf"], "grad_clip=inf must be a finite number"),
    (["--out", "/etc/passwd"], "--out /etc/passwd: exists and is not a directory"),
    (["--out", "/etc/passwd/run"], "--out /etc/passwd/run: cannot be made: /etc/passwd is not a writable directory"),
    (["--out", "/sys/pympar-run"], "--out /sys/pympar-run: cannot be made"),     # (as root too: a probe, not access())
    (["--bucket-mb", "0"], "bucket_mb=0.0 must be > 0"),
    (["--seed", "-1"], "seed=-1 must be >= 0"),
    (["--preset", "moe-tiny", "--aux-coef", "nan"], "aux_coef=nan must be a finite number"),
    (["--preset", "moe-tiny", "--capacity-factor", "1e308"], "capacity_factor=1e+308 must be in 0..n_expert=4"),
    (["--config", "__DIR__"], "Is a directory"),
])
def test_bad_config_exits_2_on_every_rank(tmp_path, args, needle):
    small = tmp_path / "s.txt"
    small.write_text("x" * 500)
    args = [str(small) if a == "__SMALL__" else str(tmp_path) if a == "__DIR__" else a for a in args]
    res = train(2, *args, check=False, timeout=60, cache=tmp_path / "cache")
    assert res.returncode == 2
    lines = error_lines(res)
    assert len(lines) == 2 and lines[0] == lines[1], res.stdout[-2000:]
    assert needle in lines[0]


@pytest.mark.parametrize("layout", [["--dp", 2], ["--pp", 2]])
def test_a_run_that_cannot_fit_is_refused_on_every_rank_before_it_allocates(layout):
    """--memory-check (on by default): each rank's ledger prediction (its pipeline stage's), summed
    over the node, against what the node has available, agreed by every rank before the model is
    built -- one line on each, exit 2, no traceback and no kill by the OS. A billion sequences per
    micro-batch need petabytes."""
    args = [*layout, "--micro-batch-size", 10**9, "--steps", 1]
    res = train(2, *args, check=False, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stdout, res.stdout[-2000:]
    lines = error_lines(res)
    assert len(lines) == 2 and lines[0] == lines[1], res.stdout[-2000:]
    cfg = parse_args([*TINY, *map(str, args)], 2, apply_environment())
    c = (cfg.model, cfg.parallel, cfg.run, cfg.optim)
    need = 2 * ledger.predict_run(*c)["peak"] if layout[0] == "--dp" else \
        sum(ledger.predict_run(*c, pp_rank=r)["peak"] for r in range(2))    # the stages hold different bytes
    assert f"its 2 rank(s) are predicted to hold {ledger.human(need)} > " in lines[0], lines[0]
    assert "--micro-batch-size" in lines[0] and "--no-memory-check runs it anyway" in lines[0]


@pytest.mark.parametrize("n", [1, 2])
def test_running_out_of_memory_anyway_ends_every_rank_with_one_line(n):
    """--no-memory-check, and an allocation the process cannot get (its address space limited to
    6 GiB, as ``ulimit -v``; the first activation of the micro-batch alone is 6.1 GiB): a clear line
    and exit status 1, not a traceback, naming the ledger's prediction; on 2 ranks the whole job ends
    (MPI_Abort) instead of one rank waiting for the other -- the rank that aborts first may end the
    other before it prints, so at least one line, every one well formed. One thread per rank: the
    address space holds no thread pools sized to the host."""
    res = train(n, "--micro-batch-size", 10**5, "--n-embd", 1024, "--steps", 1, "--no-memory-check", "--threads", 1,
                check=False, timeout=60, address_space=6 << 30)
    assert res.returncode == 1 and "Traceback" not in res.stdout, res.stdout[-3000:]
    lines = [line for line in res.stdout.splitlines() if "out of memory" in line]
    heads = {"pympar.train: error: rank 0: out of memory ("} if n == 1 else \
        {f"pympar: rank {r}: error: out of memory (" for r in range(n)}
    assert lines and all(any(line.startswith(h) for h in heads) for line in lines), res.stdout[-3000:]
    assert all("the ledger predicted" in line for line in lines), res.stdout[-3000:]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 1-rank run of the tiny model with a step-2 checkpoint."""
    out = tmp_path_factory.mktemp("saved") / "run"
    train(1, "--steps", 2, "--save-every", 2, "--sample-tokens", 0, "--out", out)
    return out / "checkpoints" / "step_00000002"


@pytest.mark.parametrize("damage, needle", [
    ("shape", "checkpoint is of another model (n_embd: checkpoint 32, model 64)"),
    ("manifest", "manifest.json"),
    ("byte", "sha256"),
], ids=["another-model", "truncated-manifest", "flipped-byte"])
def test_bad_checkpoint_ends_every_rank_with_one_line(tmp_path, saved_run, damage, needle):
    """What the manifest shows is refused on every rank before any collective (status 2, the same
    line); a shard whose bytes do not match its sha256 is found while loading by the rank that
    reads it, agreed by the ranks, and every rank says the failing rank's words, naming the file --
    never a traceback or an abort."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(saved_run, ck)
    extra = []
    if damage == "shape":
        extra = ["--n-embd", 64]
    elif damage == "manifest":
        m = ck / "manifest.json"
        m.write_bytes(m.read_bytes()[: len(m.read_bytes()) // 2])
    else:
        shard = next(p for p in ck.iterdir() if p.suffix == ".safetensors")
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0x40                                 # one byte of the last tensor
        shard.write_bytes(bytes(data))
    res = train(2, "--steps", 4, "--resume", ck, "--sample-tokens", 0, *extra, check=False, timeout=90)
    assert res.returncode == 2, res.stdout[-3000:]
    lines = error_lines(res)
    assert len(lines) == 2 and len(set(lines)) == 1, res.stdout[-3000:]
    assert needle in lines[0] and "Traceback" not in res.stdout and "MPI_Abort" not in res.stdout, res.stdout[-3000:]


@pytest.mark.parametrize("var, needle", [
    ("PYMPAR_PP_CHANNELS", "expected 0 (MPI with tags), 1 (ordered channels) or unset"),
    ("PYMPAR_NUM_THREADS", "PYMPAR_NUM_THREADS='yes' is not a number of threads"),
    ("PYMPAR_GEMM", "PYMPAR_GEMM='yes': expected one of '', 'auto', 'numpy', 'mkl'"),
])
def test_bad_environment_setting_exits_2_on_every_rank(tmp_path, var, needle):
    res = run_mpi(2, ["-m", "pympar.train", *TINY, "--steps", "1"], timeout=60, check=False, env={var: "yes"})
    assert res.returncode == 2
    lines = error_lines(res)
    assert len(lines) == 2 and lines[0] == lines[1] and needle in lines[0], res.stdout[-2000:]


NO_THREAD_VARS = {k: None for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PYMPAR_NUM_THREADS")}


def _threads_line(res):
    import re

    m = re.search(r"(\d+) thread\(s\) per rank \(([^)]*)\)", res.stdout)
    assert m, res.stdout[-2000:]
    return int(m.group(1)), m.group(2)


def test_default_threads_are_the_nodes_cores_over_its_ranks(tmp_path):
    """No thread variable set: each of 4 ranks takes (cores its node's ranks may use) / 4, at
    least 1 -- on a 2-core machine 1 -- and says why; an explicit --threads wins, and a node then
    running more threads than cores is named oversubscribed."""
    import os

    cores = len(os.sched_getaffinity(0))
    res = run_mpi(4, ["-m", "pympar.train", *TINY, "--steps", "1"], timeout=120, env=NO_THREAD_VARS)
    n, why = _threads_line(res)
    assert n == max(1, cores // 4) and f"{cores} cores / 4 ranks on this node" in why, why
    res = run_mpi(4, ["-m", "pympar.train", *TINY, "--steps", "1", "--threads", 2], timeout=120, env=NO_THREAD_VARS)
    n, why = _threads_line(res)
    assert n == 2 and why.startswith("--threads")
    assert ("oversubscribed" in why) == (8 > cores), why
    res = run_mpi(2, ["-m", "pympar.train", *TINY, "--steps", "1"], timeout=120, env=dict(NO_THREAD_VARS, OMP_NUM_THREADS=3))
    assert _threads_line(res)[0] == 3 and "OMP_NUM_THREADS" in _threads_line(res)[1]


def test_bind_cores_pins_each_rank_to_its_own_cores():
    """--bind cores: each rank's affinity mask becomes its own disjoint slice of the node's cores
    (the masks are read back after binding); where ranks x threads exceed the cores, it says why
    it did not bind."""
    import os
    import re

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    res = run_mpi(2, ["-m", "pympar.train", *TINY, "--steps", "1", "--bind", "cores"], timeout=120, env=NO_THREAD_VARS)
    n, why = _threads_line(res)
    got = re.search(r"bound, node rank:cores (.*)$", why).group(1).split()
    per = [set(map(int, g.split(":")[1].split(","))) for g in got]
    assert len(per) == 2 and all(len(c) == n for c in per) and not per[0] & per[1], why
    assert per[0] | per[1] <= set(cores)
    res = run_mpi(2, ["-m", "pympar.train", *TINY, "--steps", "1", "--bind", "cores", "--threads", str(len(cores))],
                  timeout=120, env=NO_THREAD_VARS)
    assert "not bound: 2 ranks x" in _threads_line(res)[1]


# ----------------------------------------------------------------------------- parsing in-process

def test_precedence_default_preset_file_flag(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "small"\nn_layer = 3\nmicro_batch_size = 4\n')
    c = parse_args(["--config", str(cfg), "--n-layer", "5"], world_size=1)
    assert c.model.n_embd == 128 and c.model.n_layer == 5 and c.parallel.micro_batch_size == 4 and c.run.steps == 200


def test_each_flag_belongs_to_one_section_of_the_configuration_tree():
    """One tree (model, parallel, optim, run): a name lives in one section, and a flag lands there."""
    from dataclasses import fields

    from pympar.config import RunConfig
    from pympar.nn.config import GPTConfig
    from pympar.optim import OptimConfig

    names = [{f.name for f in fields(k)} for k in (GPTConfig, layouts.Layout, OptimConfig, RunConfig)]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not a & b, a & b
    c = parse_args(["--tp", "2", "--zero", "1", "--lr", "0.01", "--warmup", "3", "--n-layer", "3", "--steps", "7"],
                   world_size=2)
    assert (c.parallel.tp, c.parallel.dp, c.parallel.zero, c.optim.lr, c.optim.warmup, c.model.n_layer, c.run.steps) \
        == (2, 1, 1, 0.01, 3, 3, 7)
    with pytest.raises(ConfigError, match="min_lr=0.5 is above lr=0.01"):    # the optimizer's own validator
        parse_args(["--lr", "0.01", "--min-lr", "0.5"], world_size=1)


def test_toml_tables_are_the_trees_sections(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\nn_layer = 3\n[parallel]\nzero = 1\n[optim]\nlr = 0.02\n[run]\nsteps = 4\n[notes]\nseed = 7\n')
    c = parse_args(["--config", str(p)], world_size=2)
    assert (c.model.n_layer, c.parallel.zero, c.optim.lr, c.run.steps, c.run.seed) == (3, 1, 0.02, 4, 7)
    p.write_text('[run]\nlr = 0.02\n')
    with pytest.raises(ConfigError, match=r"\[run\] has no key 'lr'; it belongs to \[optim\]"):
        parse_args(["--config", str(p)], world_size=1)


def test_layout_rule_and_errors(tmp_path):
    c = parse_args([], world_size=8)
    assert (c.parallel.dp, c.parallel.pp) == (8, 1) and c.run.layout_auto
    c = parse_args(["--pp", "2"], world_size=8)
    assert c.parallel.dp == 4 and not c.run.layout_auto
    with pytest.raises(ConfigError, match="not divisible by pp\\*tp"):
        parse_args(["--pp", "3"], world_size=8)
    with pytest.raises(ConfigError, match="ep=3 does not divide dp=8"):
        parse_args(["--ep", "3", "--preset", "moe-tiny"], world_size=8)
    # the experts folded apart from tp: ep over tp's ranks needs --etp below tp, and says so
    moe = ["--preset", "moe-tiny", "--tp", "2"]
    with pytest.raises(ConfigError, match="ep=4 does not divide dp=2.*--etp 1 lets ep reach over tp"):
        parse_args([*moe, "--ep", "4"], world_size=4)
    lay = parse_args([*moe, "--ep", "4", "--etp", "1"], world_size=4).parallel
    assert (lay.dp, lay.tp, lay.ep, lay.etp, lay.folded) == (2, 2, 4, 1, True) and "etp=1" in str(lay)
    assert "--etp" in lay.train_args() and not parse_args([*moe, "--etp", "2"], world_size=4).parallel.folded
    with pytest.raises(ConfigError, match="etp=3 does not divide tp=2"):
        parse_args([*moe, "--etp", "3"], world_size=4)
    with pytest.raises(ConfigError, match="--ep-dispatch node does not run with the experts folded"):
        parse_args([*moe, "--ep", "4", "--etp", "1", "--ep-dispatch", "node"], world_size=4)
    c = parse_args(["--tp", "2", "--etp", "1"], world_size=4)
    with pytest.raises(ValueError, match="etp=1 folds experts apart from tp: it needs a MoE model"):
        layouts.check(c.model, c.parallel)         # the trainer's check, on every rank
    with pytest.raises(ConfigError, match="unknown keys \\['nope'\\]"):
        p = tmp_path / "nope.toml"
        p.write_text("nope = 1\n")
        parse_args(["--config", str(p)], world_size=1)


def test_float16_run_uses_loss_scaling_and_log_lines(tmp_path):
    res = train(1, "--dtype", "float16", "--steps", 2, "--progress", "log", "--out", tmp_path)
    m = metrics(tmp_path)
    assert m[0]["loss_scale"] == 2.0 ** 16 and not m[0]["skipped"]
    assert all(np.isfinite(r["loss"]) for r in m)
    assert "step 2/2 loss" in res.stdout


@pytest.mark.parametrize("damage", ["garbage", "deleted", "a directory", "names a missing step", "no checkpoint left"])
def test_resume_auto_never_starts_over_on_checkpoints_it_could_not_point_to(tmp_path, damage):
    """--resume auto with OUT/checkpoints/latest damaged, gone or pointing nowhere: the newest
    step_N checkpoint there, with a warning (before: a fresh start that overwrote the checkpoints);
    a folder with a pointer but no checkpoint: an error on every rank, nothing overwritten."""
    import shutil

    out = tmp_path / "run"
    train(2, "--steps", 4, "--save-every", 2, "--sample-tokens", 0, "--out", out)
    ck = out / "checkpoints"
    latest = ck / "latest"
    latest.unlink()
    if damage == "garbage":
        latest.write_bytes(b"\0" * 100)
    elif damage == "a directory":
        latest.mkdir()
    elif damage == "names a missing step":
        latest.write_text("step_00000009\n")
    elif damage == "no checkpoint left":
        latest.write_text("step_00000004\n")
        for q in ck.glob("step_*"):
            shutil.rmtree(q)
    before = {q.name: (q / "manifest.json").read_bytes() for q in ck.glob("step_*")}
    res = train(2, "--steps", 6, "--sample-tokens", 0, "--out", out, "--resume", "auto", check=False)
    assert "Traceback" not in res.stdout, res.stdout[-3000:]
    if damage == "no checkpoint left":
        assert res.returncode == 2, res.stdout[-3000:]
        lines = error_lines(res)
        assert len(lines) == 2 and lines[0] == lines[1] and "no step_N folder of" in lines[0], res.stdout[-3000:]
        assert "step 1/6" not in res.stdout and latest.read_text() == "step_00000004\n"
        return
    assert res.returncode == 0, res.stdout[-3000:]
    assert res.stdout.count("pympar.train: warning: --resume auto:") == 1          # rank 0 says it
    assert f"resuming from the newest checkpoint there, {ck / 'step_00000004'}" in res.stdout, res.stdout[-3000:]
    assert "at step 4" in res.stdout and "step 1/6" not in res.stdout
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3, 4, 5]
    assert {q.name: (q / "manifest.json").read_bytes() for q in ck.glob("step_*") if q.name in before} == before


def test_links_planted_in_the_run_folder_are_replaced_not_written_through(tmp_path):
    """--out's metrics.jsonl, summary.json and trace.json, found as symbolic links to files elsewhere
    (a shared run folder): the run writes its own files in their place and the targets stay as they were."""
    out, outside = tmp_path / "run", tmp_path / "precious.txt"
    out.mkdir()
    outside.write_text("keep me\n")
    for name in ("metrics.jsonl", "summary.json", "trace.json"):
        (out / name).symlink_to(outside)
    train(1, "--steps", 2, "--out", out, "--profile")
    assert outside.read_text() == "keep me\n"
    for name in ("metrics.jsonl", "summary.json", "trace.json"):
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert [r["step"] for r in metrics(out)] == [0, 1]


@pytest.mark.parametrize("damage", ["garbage line", "foreign record", "directory", "pipe"])
def test_a_damaged_metrics_file_costs_its_records_not_the_resumed_run(tmp_path, damage):
    """--resume auto continues OUT/metrics.jsonl with the earlier run's records before the resumed
    step; a damaged line keeps those before it (a warning says which line), and a metrics.jsonl
    that cannot be read or written (a directory) leaves the run going with a warning."""
    out = tmp_path / "run"
    train(2, "--steps", 3, "--save-every", 3, "--out", out)
    m = out / "metrics.jsonl"
    if damage == "directory":
        m.unlink()
        m.mkdir()
    elif damage == "pipe":                   # opened, it would block the run (reading or writing)
        m.unlink()
        os.mkfifo(m)
    else:
        lines = m.read_bytes().splitlines(keepends=True)
        lines[1] = b"\xff\xfe not json\n" if damage == "garbage line" else b'{"step": "one"}\n'
        m.write_bytes(b"".join(lines))
    res = train(2, "--steps", 5, "--out", out, "--resume", "auto")
    assert "Traceback" not in res.stdout and "step 5/5 loss" in res.stdout, res.stdout[-3000:]
    if damage == "directory":
        assert f"pympar.train: warning: {m} cannot be read (Is a directory)" in res.stdout, res.stdout[-3000:]
        assert f"pympar.train: warning: cannot write {m} (Is a directory)" in res.stdout, res.stdout[-3000:]
    elif damage == "pipe":
        assert f"pympar.train: warning: {m} cannot be read (not a regular file)" in res.stdout, res.stdout[-3000:]
        assert f"pympar.train: warning: cannot write {m} (a named pipe, not a file)" in res.stdout, res.stdout[-3000:]
    else:
        assert f"pympar.train: warning: {m}: line 2 is" in res.stdout and "the 1 record(s) of earlier steps before it are kept" \
            in res.stdout, res.stdout[-3000:]
        assert [r["step"] for r in metrics(out)] == [0, 3, 4]


def test_every_checkpoint_command_takes_a_run_dir_its_checkpoints_folder_or_one_step(tmp_path):
    import subprocess
    import sys

    from mpirun import ROOT, mpi_env

    first = tmp_path / "first"
    train(1, "--steps", 4, "--save-every", 2, "--out", first)
    steps = sorted(p.name for p in (first / "checkpoints").glob("step_*"))
    assert steps and steps[-1].endswith("4"), steps
    forms = {"run dir": first, "checkpoints folder": first / "checkpoints",
             "one step": first / "checkpoints" / steps[-1]}
    for i, (what, form) in enumerate(forms.items()):
        for cmd in (["inspect", form], ["export", form, tmp_path / f"m{i}.safetensors"]):
            r = subprocess.run([sys.executable, "-m", "pympar.checkpoint", *map(str, cmd)], capture_output=True,
                               text=True, env=mpi_env(), cwd=ROOT / "tests", timeout=60)
            assert r.returncode == 0, (what, cmd[0], r.stdout + r.stderr)
        res = train(1, "--steps", 6, "--out", tmp_path / f"again{i}", "--resume", form)
        assert "at step 4" in res.stdout, (what, res.stdout[-2000:])
        assert metrics(tmp_path / f"again{i}")[-1]["step"] == metrics(first)[-1]["step"] + 2   # 2 steps more
    done = train(1, "--steps", 4, "--out", tmp_path / "done", "--resume", first)   # a finished run: said so
    assert "at step 4; --steps is 4: nothing left to train" in done.stdout, done.stdout[-2000:]
    bad = train(1, "--steps", 6, "--resume", tmp_path, check=False)      # not a run, nor checkpoints
    assert bad.returncode == 2 and any("looked for" in ln and "(a run directory, the trainer's --out)" in ln
                                       for ln in error_lines(bad)), bad.stdout


def test_progress_auto_follows_what_the_launcher_writes_to(tmp_path):
    # mpirun's output captured (a pipe, as `mpirun ... > run.log` gives a file): log lines, no bar
    res = train(2, "--steps", 12, "--log-every", 4)
    assert "\r" not in res.stdout and "step/s" not in res.stdout, res.stdout[-1500:]
    assert any(line.startswith("step 12/12") for line in res.stdout.splitlines()), res.stdout[-1500:]
    # mpirun on a terminal (a pseudo-terminal made by util-linux `script`): rank 0 draws the bar,
    # although its own stdout is the launcher's pipe
    import shutil
    import subprocess

    from mpirun import ROOT, mpi_env, mpiexec
    if shutil.which("script") is None:
        pytest.skip("util-linux `script` (a pseudo-terminal) is not installed")
    import sys
    cmd = " ".join([mpiexec(), "-n", "2", sys.executable, "-m", "pympar.train", *TINY, "--steps", "12"])
    typescript = tmp_path / "typescript"
    p = subprocess.run(["script", "-qec", cmd, str(typescript)], capture_output=True, text=True, env=mpi_env(),
                       cwd=ROOT / "tests", timeout=90)
    shown = typescript.read_bytes().decode(errors="replace")       # read_text would turn \r into \n
    assert p.returncode == 0, (p.returncode, p.stdout[-500:], p.stderr[-500:], shown[-1500:])
    assert "step/s" in shown and "\r" in shown, shown[-1500:]
    # the same under the supervisor on a terminal (pympar.launch -> mpiexec -> the ranks)
    cmd = " ".join([sys.executable, "-m", "pympar.launch", "-n", "2", "--", *TINY, "--steps", "12",
                    "--out", str(tmp_path / "launched")])
    p = subprocess.run(["script", "-qec", cmd, str(typescript)], capture_output=True, text=True, env=mpi_env(),
                       cwd=ROOT / "tests", timeout=90)
    shown = typescript.read_bytes().decode(errors="replace")
    assert p.returncode == 0 and "step/s" in shown and "\r" in shown, shown[-1500:]


def test_the_start_up_line_names_the_gemm_library(tmp_path):
    """The trainer says which library multiplies (pympar/kernels/gemm.py): MKL where installed
    (CI installs the extra), NumPy's BLAS when PYMPAR_GEMM=numpy asks for it."""
    from pympar.kernels import gemm

    res = run_mpi(1, ["-m", "pympar.train", *TINY, "--steps", "1"], timeout=120)
    want = "GEMM MKL (" if gemm._load() else "GEMM NumPy's BLAS (no MKL found)"
    assert want in res.stdout, res.stdout[-2000:]
    res = run_mpi(1, ["-m", "pympar.train", *TINY, "--steps", "1"], timeout=120, env={"PYMPAR_GEMM": "numpy"})
    assert "GEMM NumPy's BLAS (PYMPAR_GEMM=numpy)" in res.stdout, res.stdout[-2000:]


_NO_NATIVE = ("import sys; sys.modules['pympar._C'] = None\n"     # pympar._C cannot import (a copy without it)
              "import pympar.train as t; sys.exit(t.main(sys.argv[1:]))\n")


def test_a_missing_native_module_stops_every_rank_with_one_line_unless_asked_for():
    """Without pympar._C every kernel would run the NumPy reference, 10-100x slower, and the run would
    report that speed: each rank says so in one line and exits 2 before any collective; with
    PYMPAR_KERNELS=reference the same run trains on the reference and its start-up line says so."""
    res = run_mpi(2, ["-c", _NO_NATIVE, *TINY, "--steps", "1"], timeout=90, check=False)
    errs = error_lines(res)
    assert res.returncode == 2 and len(errs) == 2, res.stdout[-2000:]
    assert all("pympar._C" in e and "PYMPAR_KERNELS=reference" in e and "pip install" in e for e in errs)
    assert "Traceback" not in res.stdout
    res = run_mpi(1, ["-c", _NO_NATIVE, *TINY, "--steps", "1"], timeout=90, env={"PYMPAR_KERNELS": "reference"})
    assert "kernels reference (PYMPAR_KERNELS=reference)" in res.stdout


def test_the_start_up_line_names_the_kernels():
    import pympar.kernels as K
    res = train(1, "--steps", 1)
    assert f"kernels {K.describe()};" in res.stdout and (not K.native_available() or "kernels C++ " in res.stdout)


def test_dtype_auto_follows_the_cpu():
    """--dtype auto (the default): bfloat16 where the CPU multiplies bf16 natively, float32 where it
    does not -- PYMPAR_ISA=avx2 runs the AVX2 kernels, i.e. such a CPU; --dtype float32 insists."""
    from pympar.kernels import gemm
    res = train(1, "--steps", 1)
    native = gemm.bf16_native()
    assert ("compute bfloat16 (auto: this CPU multiplies bf16 natively)" in res.stdout) == native, res.stdout[:600]
    if native:
        assert f"bf16 products on {gemm.describe_bf16()}" in res.stdout
    avx2 = gemm.cpu_features().get("avx2")
    res = run_mpi(1, ["-m", "pympar.train", *TINY, "--steps", "1"], timeout=90,
                  env={"PYMPAR_ISA": "avx2" if avx2 else "generic"})
    assert "compute float32 (auto: no native bf16 products here)" in res.stdout
    res = train(1, "--steps", 1, "--dtype", "float32")
    assert "compute float32;" in res.stdout


def test_grad_reduce_dtype_is_the_bf16_gradient_sync():
    """--grad-reduce-dtype bfloat16 runs the bf16 DP reduction of --compress bf16 (the same numbers),
    and refuses another compression beside it."""
    env_args = ["--steps", 2, "--dp", 2, "--dtype", "float32"]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        train(2, *env_args, "--grad-reduce-dtype", "bfloat16", "--out", f"{d}/a")
        train(2, *env_args, "--compress", "bf16", "--out", f"{d}/b")
        a, b = metrics(f"{d}/a"), metrics(f"{d}/b")
        assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    res = train(2, *env_args, "--grad-reduce-dtype", "bfloat16", "--compress", "topk", check=False)
    assert res.returncode == 2 and "grad_reduce_dtype=bfloat16 is --compress bf16" in res.stdout


def test_ulysses_context_parallelism_trains_the_ring_and_the_one_process_run(tmp_path):
    """--cp 2 --cp-comm a2a (two all-to-alls around whole-sequence attention of half the heads) and
    --cp 2 with the ring train the single process's losses (float32; the layouts' tolerance, tests/mpi/
    mpi_layouts.py: 1e-3 relative, the orders of the sums differing)."""
    args = ["--steps", "4", "--sample-tokens", "0", "--eval-every", "0", "--dtype", "float32", "--n-micro", "2"]
    got = {}
    for name, n, extra in (("one", 1, []), ("ring", 2, ["--cp", "2"]), ("a2a", 2, ["--cp", "2", "--cp-comm", "a2a"])):
        train(n, *args, *extra, "--out", tmp_path / name)
        got[name] = [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert len(got["a2a"]) == 4
    for name in ("ring", "a2a"):
        assert got[name] == pytest.approx(got["one"], rel=1e-3), got


def test_expert_replicas_train_the_run_without_them_and_even_the_ranks(tmp_path):
    """--expert-replicas 2 --replan-every 2 on ep 4 with the balancing losses off (the router then
    favours a few experts): the losses are the run's without replicas (float32, the orders of the
    sums differing: 1e-5 relative), and once the replicas are placed the busiest rank's rows over
    the mean fall below the run's without them (the same steps, the same routing)."""
    args = ["--preset", "moe-small", "--ep", "4", "--n-expert", "8", "--aux-coef", "0", "--z-coef", "0",
            "--steps", "6", "--sample-tokens", "0", "--eval-every", "0", "--dtype", "float32", "--threads", "1"]
    got = {}
    for name, extra in (("none", []), ("replicas", ["--expert-replicas", "2", "--replan-every", "2"])):
        train(4, *args, *extra, "--out", tmp_path / name, timeout=180)
        got[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in got["replicas"]] == pytest.approx([r["loss"] for r in got["none"]], rel=1e-5)
    worst = {k: max(m["rank_max_over_mean"] for r in v[2:] for m in r["moe"]) for k, v in got.items()}
    assert worst["replicas"] < worst["none"], worst
    bad = train(4, *args, "--expert-replicas", "2", "--zero", "3", "--out", tmp_path / "bad", check=False)
    assert bad.returncode == 2 and bad.stdout.count("--expert-replicas: ZeRO-3 shards the experts' weights") == 4
    # a resumed run carries on with the checkpoint's placement, window and step count: the same bits
    # as the run that went on (placed at steps 2 and 4; saved at step 3, between them)
    rep = ["--expert-replicas", "2", "--replan-every", "2"]
    train(4, *args, *rep, "--save-every", "3", "--out", tmp_path / "saved", timeout=180)
    at3 = next(p for p in (tmp_path / "saved" / "checkpoints").glob("step_*") if p.name.lstrip("step_0") == "3")
    train(4, *args, *rep, "--resume", at3, "--out", tmp_path / "resumed", timeout=180)
    whole = [json.loads(x)["loss"] for x in (tmp_path / "saved" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x)["loss"] for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert len(again) == 3 and again == whole[3:], (whole, again)
