"""Generation with a key/value cache: equal to the uncached path token for token, to transformers'
greedy decoding of an exported model, and the CLI on each checkpoint form."""
import re
import subprocess
import sys

import numpy as np
import pytest

from mpirun import ROOT, mpi_env, run_mpi
from pympar.checkpoint import save_training
from pympar.nn.config import GPTConfig
from pympar.nn.generate import generate
from pympar.nn.gpt import GPT


def _model(preset, **over):
    cfg = GPTConfig.from_preset(preset)
    for k, v in over.items():
        setattr(cfg, k, v)
    return GPT(cfg.validate())


@pytest.mark.parametrize("preset", ["tiny", "moe-tiny"])
def test_cache_equals_the_uncached_path_greedy_and_sampled(preset):
    m = _model(preset, block_size=32)
    prompt = np.array([[10, 20, 30], [1, 2, 3]])
    for top_k, seed in ((1, 0), (8, 5), (None, 9)):
        a = generate(m, prompt, 45, top_k=top_k, rng=np.random.default_rng(seed), cache=True)   # past block_size
        b = generate(m, prompt, 45, top_k=top_k, rng=np.random.default_rng(seed), cache=False)
        assert a.shape == (2, 48)
        np.testing.assert_array_equal(a, b, err_msg=f"top_k={top_k}")


def test_greedy_equals_transformers_generate_on_an_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from pympar.checkpoint.convert import export_hf

    m = _model("tiny", n_layer=3, n_embd=64, n_head=4)
    save_training(tmp_path / "ck", 1, m)
    export_hf(tmp_path / "ck", tmp_path / "hf")
    t = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    prompt = np.array([[100, 101, 32, 40, 41]])
    with torch.no_grad():
        theirs = t.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                            pad_token_id=0).numpy()
    ours = generate(m, prompt, 32, top_k=1)
    np.testing.assert_array_equal(ours, theirs)


def test_cli_samples_from_every_checkpoint_form(tmp_path):
    run = tmp_path / "run"
    run_mpi(1, ["-m", "pympar.train", "--preset", "tiny", "--steps", "2", "--save-every", "2", "--sample-tokens", "0",
                "--eval-iters", "1", "--out", run], timeout=90)
    step = sorted((run / "checkpoints").glob("step_*"))[-1]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pympar.generate", *map(str, args)], capture_output=True,
                              text=True, env=mpi_env(), cwd=ROOT / "tests", timeout=60)
    outs = []
    for form in (run, run / "checkpoints", step):
        r = cli(form, "--prompt", "def ", "--tokens", "24", "--top-k", "1")
        assert r.returncode == 0 and r.stdout.startswith("def ") and "24 tokens from step 2" in r.stderr, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] == outs[2]
    assert cli(run, "--prompt", "def ", "--tokens", "24", "--top-k", "1", "--no-cache").stdout == outs[0]
    r = cli(tmp_path, "--prompt", "x")
    assert r.returncode == 2 and r.stderr.startswith("pympar.generate: error:") and "looked for" in r.stderr
    r = cli(run, "--prompt-ids", "300")
    assert r.returncode == 2 and "prompt ids must be 0..255" in r.stderr
    for args, want in ((("--seed", "-1"), "--seed >= 0"), (("--prompt", "x", "--prompt-ids", "1"), "not both"), (("--prompt", "\n", "--prompt-ids", "1"), "not both"),
                       (("--prompt", ""), "--prompt is empty"), (("--prompt-ids", "a,b"), "comma-separated integers"),
                       (("--temperature", "inf"), "a finite number > 0")):
        r = cli(run, *args)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-500:])


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_generation_on_a_layout_equals_one_process(n, tmp_path):
    """tests/mpi/mpi_generate.py: tp, pp (plain, interleaved, V), ep and dp layouts, dense and MoE."""
    from mpirun import run_pytest_mpi
    run_pytest_mpi(n, "mpi_generate.py", timeout=180, env={"GEN_DIR": str(tmp_path)})


@pytest.mark.mpi
def _decodes_as_one_process(tmp_path, train, tokens, cases):
    """Train 2 steps on 4 ranks with ``train``'s flags (a checkpoint at step 2); for each (ranks,
    extra flags, layout words) `python -m pympar.generate` on that many ranks prints the text one
    process samples and names the layout. -> (the generate arguments, each case's output)."""
    run = tmp_path / "run"
    run_mpi(4, ["-m", "pympar.train", *train, "--steps", "2", "--save-every", "2", "--sample-tokens", "0",
                "--eval-iters", "1", "--out", run], timeout=120)
    args = ["-m", "pympar.generate", run, "--prompt", "def ", "--tokens", str(tokens), "--seed", "3"]
    one = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=mpi_env(),
                         cwd=ROOT / "tests", timeout=60)
    assert one.returncode == 0, one.stderr
    outs = []
    for n, extra, where in cases:
        r = run_mpi(n, [*args, *extra], timeout=120)
        assert r.stdout.startswith(one.stdout), (n, extra, r.stdout[:300], one.stdout[:300])
        assert f"{tokens} tokens from step 2" in r.stdout and where in r.stdout, r.stdout[-500:]
        outs.append(r.stdout)
    return args, outs


def test_cli_decodes_a_folded_expert_layout(tmp_path):
    """A MoE run with its experts folded apart from tp (tp 2 x dp 2 for attention, ep 4 with whole
    experts): `python -m pympar.generate` decodes on the saved folded layout, on a smaller folded one
    (2 ranks: --tp 2 --ep 2 --etp 1) and unfolded (--tp 2 --ep 1) the text one process samples."""
    _decodes_as_one_process(tmp_path, ["--preset", "moe-tiny", "--tp", "2", "--ep", "4", "--etp", "1"], 30,
                            [(4, [], "tp=2 pp=1 ep=4 dp=2 etp=1"), (2, ["--ep", "2", "--etp", "1"], "ep=2 dp=1 etp=1"),
                             (2, ["--tp", "2", "--ep", "1"], "tp=2 pp=1 ep=1 dp=1")])


def test_cli_places_expert_replicas_once_from_the_prompt(tmp_path):
    """--expert-replicas R on an ep 4 layout: the prompt's prefill measures the expert loads, the
    replicas are placed once from them (the busiest experts copied to the least-loaded ranks), and the
    text is still the one process's; on a layout replicas cannot serve (tp 2) every rank refuses."""
    args, outs = _decodes_as_one_process(tmp_path, ["--preset", "moe-tiny", "--ep", "4"], 30,
                                         [(4, ["--expert-replicas", "2"], "ep=4 dp=4")])
    line = next(x for x in outs[0].splitlines() if "replicas placed once from the prompt's loads" in x)
    pairs = [(float(b), float(r)) for b, r in re.findall(r"layer \d+ ([\d.]+) -> ([\d.]+)", line)]
    assert len(pairs) == 2 and all(r <= b for b, r in pairs) and any(r < b for b, r in pairs), line
    r = run_mpi(4, [*args, "--tp", "2", "--ep", "2", "--expert-replicas", "1"], timeout=60, check=False)
    assert r.returncode != 0 and r.stdout.count("--expert-replicas 1: replicas copy whole experts") == 4, r.stdout


def test_cli_decodes_on_the_saved_layout_and_refuses_what_does_not_fit(tmp_path):
    """A tp 2 x pp 2 run's checkpoint: `mpiexec -n 4 python -m pympar.generate` decodes on that
    layout (and -n 8 with two replicas, -n 2 with --pp 1) the text one process samples; 3 ranks
    are refused on every rank with what would fit, before any collective."""
    args, _ = _decodes_as_one_process(tmp_path, ["--preset", "tiny", "--tp", "2", "--pp", "2", "--n-micro", "2"], 40,
                                   [(4, [], "tp=2 pp=2 ep=1 dp=1"), (8, [], "tp=2 pp=2 ep=1 dp=2"),
                                    (2, ["--pp", "1"], "tp=2 pp=1 ep=1 dp=1")])
    r = run_mpi(3, args, timeout=60, check=False)
    assert r.returncode != 0
    for rank in range(3):
        assert (f"pympar.generate: error (rank {rank}): 3 ranks do not divide into tp=2 x pp=2 (the layout the "
                f"checkpoint was saved with: tp=2, pp=2): run on a multiple of 4 ranks") in r.stdout


def test_a_checkpoint_with_non_finite_weights_is_one_line_on_every_rank(tmp_path):
    """A NaN weight (through an import, whose checksums are new) made sampling raise 'Probabilities
    contain NaN' on the rank holding the logits while the others waited: now one line per rank,
    agreed right after loading (2 ranks: the stage that does not hold the parameter says it too)."""
    from safetensors.numpy import load_file, save_file

    save_training(tmp_path / "ck", 1, _model("tiny"))
    src = tmp_path / "m.st"
    env, cwd = mpi_env(), ROOT / "tests"
    r = subprocess.run([sys.executable, "-m", "pympar.checkpoint", "export", tmp_path / "ck", src], capture_output=True,
                       text=True, env=env, cwd=cwd, timeout=60)
    assert r.returncode == 0, r.stderr
    d = load_file(src)
    name = "transformer.h.1.mlp.c_fc.weight"
    d[name] = d[name].copy()
    d[name][0, 0] = np.nan
    save_file(d, tmp_path / "nan.st")
    r = subprocess.run([sys.executable, "-m", "pympar.checkpoint", "import", tmp_path / "nan.st", tmp_path / "nanck",
                        "--n-head", "2"], capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    assert r.returncode == 0, r.stderr
    want = f"parameter {name} holds non-finite values (NaN or inf): nothing to sample from"
    r = subprocess.run([sys.executable, "-m", "pympar.generate", tmp_path / "nanck", "--tokens", "4"],
                       capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    res = run_mpi(2, ["-m", "pympar.generate", tmp_path / "nanck", "--tokens", "4", "--pp", "2"], timeout=90, check=False)
    assert res.returncode == 2 and "Traceback" not in res.stdout, res.stdout[-2000:]
    assert sorted(ln.split(":")[1] for ln in res.stdout.splitlines() if want in ln) == \
        [" error (rank 0)", " error (rank 1)"], res.stdout[-2000:]


@pytest.mark.parametrize("field, value", [("tp", [2]), ("tp", None), ("tp", 0), ("pp", -2), ("etp", "1"),
                                          ("virtual_stages", 1.5), ("ep", True)])
def test_the_saved_layout_is_checked_before_it_is_used(field, value):
    """A checkpoint's meta.layout comes from a file: a wrong size is the ValueError generate prints as
    its one line (a list was a TypeError traceback; pp -2 said 'run on a multiple of -4 ranks')."""
    from pympar.generate import saved_layout
    assert saved_layout({"layout": {"tp": 2, "pp": 1, "etp": None}})["tp"] == 2
    with pytest.raises(ValueError, match=rf"meta.layout.{field} is .*: expected an integer >= 1"):
        saved_layout({"layout": {field: value}})
