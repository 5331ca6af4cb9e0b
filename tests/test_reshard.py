"""Resharding through the trainer, under mpiexec: a checkpoint written by layout A resumes in layout B
and training continues with the numbers of the uninterrupted run on A.

For each pair (A -> B): ``python -m pympar.train`` on A runs N steps with ``--save-every K`` (that run
is the reference: saving does not change it); a second job on B resumes from A's step-K checkpoint
for the remaining steps. Losses and gradient norms of steps K..N-1 equal the reference's (rel 1e-5,
float32), MoE routing counts are identical, and B's final checkpoint (exported with
``python -m pympar.checkpoint export``, and its optimiser state) matches A's. The global batch is the
same in every layout: micro_batch_size x n_micro x dp = 2 x 4 sequences.

Also: a pp2 x tp2 checkpoint exported to one safetensors file loads into the PyTorch reference model
(tests/torch_ref.py) with the same logits; imported back, it starts a dp2 run whose first loss is the
one PyTorch computes on that batch; and a resume that lost its optimiser state is caught by the
tolerance used here (the pair test can fail).
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.mpi

N, K = 6, 3                      # steps in all, checkpoint after K
GLOBAL_MICRO = 4                 # micro-batches per step over all dp ranks
SMALL = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--micro-batch-size", "2",
         "--eval-iters", "1", "--eval-every", "0", "--sample-tokens", "0", "--progress", "log",
         "--lr", "3e-3", "--warmup", "1", "--steps", str(N),
         "--dtype", "float32"]   # the float32 tolerance below (a model's own --dtype, later in the line, wins)
DENSE = ["--preset", "tiny"]
MOE = ["--preset", "moe-tiny", "--bias-update-rate", "0.01"]     # expert_bias moves: it must be carried

# (id, model, layout A, layout B); a layout string is the trainer's flags, --dp always given
PAIRS = [
    ("dense-1-to-dp2", DENSE, "--dp 1", "--dp 2"),
    ("dense-dp2zero1-to-pp2", DENSE, "--dp 2 --zero 1", "--dp 1 --pp 2"),
    ("dense-pp2tp2-to-dp4", DENSE, "--dp 1 --pp 2 --tp 2", "--dp 4"),
    ("moe-dp4ep2-to-dp2pp2ep2zero1", MOE, "--dp 4 --ep 2", "--dp 2 --pp 2 --ep 2 --zero 1"),
    ("dense-tp2sp-to-1", DENSE, "--dp 1 --tp 2 --seq-parallel", "--dp 1"),
    ("moe-1-to-dp2ep2zero1", MOE, "--dp 1", "--dp 2 --ep 2 --zero 1"),
    ("dense-dp2zero3-to-tp2", DENSE, "--dp 2 --zero 3", "--dp 1 --tp 2"),
    ("moe-dp2ep2-to-dp4ep2zero3", MOE, "--dp 2 --ep 2", "--dp 4 --ep 2 --zero 3 --recompute full"),
    ("dense-pp2zero2-to-dp2tp2zero3", DENSE, "--dp 2 --pp 2 --zero 2", "--dp 2 --tp 2 --zero 3 --seq-parallel"),
    ("dense-dp2cp2zero1-to-tp2", DENSE, "--dp 2 --cp 2 --zero 1", "--dp 1 --tp 2"),
    ("moe-1-to-cp2ep2zero2", MOE, "--dp 1", "--dp 1 --cp 2 --ep 2 --zero 2"),
    # experts folded apart from tp (whole experts, ep over the tp ranks) -> split over tp, ep over dp
    ("moe-folded-dp2tp2ep4etp1zero1-to-dp2tp2ep2", MOE, "--dp 2 --tp 2 --ep 4 --etp 1 --zero 1", "--dp 2 --tp 2 --ep 2"),
]
SLOW_PAIRS = [
    ("dense-dp2tp2zero1-to-pp2tp2", DENSE, "--dp 2 --tp 2 --zero 1", "--dp 1 --pp 2 --tp 2"),
    ("moe-dp2pp2ep2zero1gpipe-to-dp4ep4zero1", MOE, "--dp 2 --pp 2 --ep 2 --zero 1 --schedule gpipe",
     "--dp 4 --ep 4 --zero 1"),
    ("moe-dp2tp2ep2-to-1", MOE, "--dp 2 --tp 2 --ep 2", "--dp 1"),
    ("dense-float16-dp2zero1-to-pp2", DENSE + ["--dtype", "float16"], "--dp 2 --zero 1", "--dp 1 --pp 2"),
    ("dense-interleaved-to-dp2tp2sp", DENSE + ["--n-layer", "4"],
     "--dp 1 --pp 2 --schedule interleaved --virtual-stages 2", "--dp 2 --tp 2 --seq-parallel"),
    ("moe-dp2ep2-to-pp2tp2", MOE, "--dp 2 --ep 2", "--dp 1 --pp 2 --tp 2"),
    ("moe-dp4ep2zero3-to-dp2pp2ep2zero3", MOE, "--dp 4 --ep 2 --zero 3", "--dp 2 --pp 2 --ep 2 --zero 3"),
    ("dense-dp4zero3-to-dp4zero1", DENSE, "--dp 4 --zero 3 --recompute selective", "--dp 4 --zero 1"),
    ("dense-cp4-to-pp2cp2", DENSE, "--dp 1 --cp 4", "--dp 1 --pp 2 --cp 2"),
    ("moe-dp2tp2ep2-to-folded-tp2ep2etp1zero2", MOE, "--dp 2 --tp 2 --ep 2", "--dp 1 --tp 2 --ep 2 --etp 1 --zero 2"),
]


def _world(layout: list) -> tuple:
    """(world size, dp) of a layout's flags."""
    get = {k: int(layout[layout.index(k) + 1]) for k in ("--dp", "--pp", "--tp", "--cp") if k in layout}
    return get.get("--dp", 1) * get.get("--pp", 1) * get.get("--tp", 1) * get.get("--cp", 1), get.get("--dp", 1)


def train(text, model, layout: str, out, *extra, timeout=150):
    """Run the trainer on ``layout``; returns its metrics.jsonl records."""
    lay = layout.split()
    n, dp = _world(lay)
    run_mpi(n, ["-m", "pympar.train", "--data", text, *SMALL, *model, *lay, "--n-micro", str(GLOBAL_MICRO // dp),
                "--out", str(out), *map(str, extra)], timeout=timeout)
    return [json.loads(line) for line in open(f"{out}/metrics.jsonl")]


def cli(*args):
    """python -m pympar.checkpoint ... (one process, launched like the trainer)."""
    return run_mpi(1, ["-m", "pympar.checkpoint", *map(str, args)], timeout=60)


def ckpt(out, step):
    return f"{out}/checkpoints/step_{step:08d}"


def assert_same_steps(ref, got, steps, rel=1e-5):
    """Per step: loss and grad norm within rel, MoE routing counts equal."""
    by_step = {r["step"]: r for r in ref}
    assert [r["step"] for r in got] == list(steps), [r["step"] for r in got]
    for r in got:
        a = by_step[r["step"]]
        for k in ("loss", "grad_norm"):
            assert r[k] == pytest.approx(a[k], rel=rel), (k, r["step"], a[k], r[k])
        assert [m["tokens_per_expert"] for m in r["moe"]] == [m["tokens_per_expert"] for m in a["moe"]], r["step"]


def read_all(directory):
    """{key: whole array} of every tensor in a checkpoint (model and optimiser state)."""
    from pympar.checkpoint import Checkpoint

    ck = Checkpoint(directory)
    return {k: ck.read(k) for k in ck.tensors}, ck


def assert_written_once(ck):
    """Every element of every tensor is in exactly one stored piece: DP replicas, tp-replicated
    tensors and the tied wte of the first and last pipeline stage are written once."""
    for key, t in ck.tensors.items():
        full = int(np.prod(t["full_shape"]))
        stored = sum(int(np.prod([sum(b - a for a, b in dim) for dim in p["index"]])) if p["index"] else full
                     for p in t["pieces"])
        assert stored == full, (key, full, stored, t["pieces"])


def _pair(text, tmp_path, model, a, b):
    A, B = tmp_path / "a", tmp_path / "b"
    ref = train(text, model, a, A, "--save-every", K)              # uninterrupted, N steps
    got = train(text, model, b, B, "--resume", ckpt(A, K), "--save-every", K)
    assert_same_steps(ref, got, range(K, N))
    # the final state: the exported model (CLI) and the optimiser state, whatever wrote them
    from pympar.checkpoint.safetensors_format import read_all as read_file
    for d in (A, B):
        cli("export", ckpt(d, N), d / "model.safetensors")
    wa, _ = read_file(A / "model.safetensors")
    wb, _ = read_file(B / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    for k in wa:
        np.testing.assert_allclose(wb[k], wa[k], rtol=1e-5, atol=1e-6, err_msg=k)
    sa, cka = read_all(ckpt(A, N))
    sb, ckb = read_all(ckpt(B, N))
    assert sorted(sa) == sorted(sb)
    for k in sa:
        if k.startswith("optim."):
            np.testing.assert_allclose(sb[k], sa[k], rtol=1e-4, atol=1e-9 * max(1.0, float(np.abs(sa[k]).max())),
                                       err_msg=k)
    assert_written_once(cka)
    assert_written_once(ckb)
    assert ckb.meta["optimizer"]["step"] == cka.meta["optimizer"]["step"] == N
    lay_b = dict(zip(b.split()[::2], b.split()[1::2]))
    assert ckb.meta["layout"]["dp"] == int(lay_b["--dp"]) and ckb.meta["next_step"] == N


@pytest.mark.parametrize("model, a, b", [p[1:] for p in PAIRS], ids=[p[0] for p in PAIRS])
def test_reshard_pair_continues_the_reference(text, tmp_path, model, a, b):
    _pair(text, tmp_path, model, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("model, a, b", [p[1:] for p in SLOW_PAIRS], ids=[p[0] for p in SLOW_PAIRS])
def test_more_reshard_pairs(text, tmp_path, model, a, b):
    _pair(text, tmp_path, model, a, b)


@pytest.mark.parametrize("model, layout", [(DENSE, "--dp 1 --pp 2 --tp 2 --seq-parallel"),
                                           (MOE, "--dp 2 --pp 2 --ep 2 --zero 1")], ids=["pp2tp2sp", "moe-dp2pp2ep2zero1"])
def test_same_layout_resume_is_bitwise(text, tmp_path, model, layout):
    """Composed layouts resume bitwise in their own layout: every logged number and every stored tensor."""
    A, B = tmp_path / "a", tmp_path / "b"
    ref = train(text, model, layout, A, "--save-every", K)
    got = train(text, model, layout, B, "--resume", ckpt(A, K), "--save-every", K)
    def numbers(rows):          # not the timings
        return [(r["loss"], r["grad_norm"], [(m["tokens_per_expert"], m["dropped_fraction"]) for m in r["moe"]])
                for r in rows]
    assert numbers(got) == numbers(ref[K:])
    sa, _ = read_all(ckpt(A, N))
    sb, _ = read_all(ckpt(B, N))
    assert sorted(sa) == sorted(sb)
    for k in sa:
        np.testing.assert_array_equal(sb[k], sa[k], err_msg=k)


def test_resume_without_optimizer_state_is_caught(text, tmp_path):
    """The pair test's tolerance sees a lost optimiser state: the weights alone give step K's loss
    but not the steps after it."""
    A = tmp_path / "a"
    ref = train(text, DENSE, "--dp 1", A, "--save-every", K)
    bad = tmp_path / "no-optim"
    shutil.copytree(ckpt(A, K), bad)
    mf = json.loads((bad / "manifest.json").read_text())
    mf["tensors"] = {k: v for k, v in mf["tensors"].items() if not k.startswith("optim.")}
    (bad / "manifest.json").write_text(json.dumps(mf))
    got = train(text, DENSE, "--dp 2", tmp_path / "b", "--resume", bad)
    assert_same_steps(ref, got[:1], [K])
    with pytest.raises(AssertionError):
        assert_same_steps(ref, got, range(K, N))


def test_export_pp2_tp2_loads_in_pytorch_and_imports_into_dp2(text, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from torch_ref import TorchGPT

    from pympar.data import load_corpus, local_micro_batches
    from pympar.nn import GPT, GPTConfig

    A = tmp_path / "a"
    train(text, DENSE, "--dp 1 --pp 2 --tp 2", A, "--save-every", K)
    f = tmp_path / "model.safetensors"
    cli("export", A / "checkpoints", f)                    # the latest: step N
    _, ck = read_all(ckpt(A, N))
    cfg = GPTConfig(**{k: v for k, v in ck.meta["config"].items()})
    sd = load_file(str(f))
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    tm = TorchGPT(cfg)
    tm.load_state_dict(sd, strict=True)
    ours = GPT(cfg, seed=123)                              # another seed: every number comes from the file
    ours.load_state_dict({k: v.numpy() for k, v in sd.items()})
    idx = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, cfg.block_size))
    with torch.no_grad():
        tl, _ = tm(torch.tensor(idx))
    np.testing.assert_allclose(ours.logits(idx), tl.numpy(), rtol=1e-4, atol=1e-5)

    imp = tmp_path / "imported"
    cli("import", f, imp)
    got = train(text, DENSE, "--dp 2", tmp_path / "b", "--resume", imp)
    assert [r["step"] for r in got] == list(range(N))       # an import starts at step 0
    corpus = load_corpus(text)
    seed = int(ck.meta["seed"])
    batches = local_micro_batches(corpus.train, seed, 0, 0, GLOBAL_MICRO, 2, cfg.block_size)
    with torch.no_grad():
        want = float(np.mean([tm(torch.tensor(x), torch.tensor(y))[1].item() for x, y in batches]))
    assert got[0]["loss"] == pytest.approx(want, rel=1e-5), (got[0]["loss"], want)


def test_the_documented_pairs_are_the_tested_ones():
    """docs/checkpoint.md's table lists as many CI and slow pairs as PAIRS and SLOW_PAIRS hold."""
    table = (Path(__file__).resolve().parent.parent / "docs" / "checkpoint.md").read_text().splitlines()
    rows = [r for r in table if r.startswith("| ") and r.rstrip().endswith(("| yes |", "| slow |"))]
    assert sum(r.rstrip().endswith("| yes |") for r in rows) == len(PAIRS)
    assert sum(r.rstrip().endswith("| slow |") for r in rows) == len(SLOW_PAIRS)
