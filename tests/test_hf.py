"""Hugging Face transformers round trip: pympar -> GPT2LMHeadModel -> pympar (transformers is test-only)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from mpirun import ROOT, mpi_env, run_mpi
from pympar.checkpoint import Checkpoint, CheckpointMismatch, save_training
from pympar.checkpoint.convert import export_hf, import_hf
from pympar.nn.config import GPTConfig
from pympar.nn.gpt import GPT

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _model(preset="tiny", seed=0, **over):
    cfg = GPTConfig.from_preset(preset)
    for k, v in over.items():
        setattr(cfg, k, v)
    return GPT(cfg.validate(), seed=seed)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pympar.checkpoint", *map(str, args)], capture_output=True,
                          text=True, env=mpi_env(), cwd=ROOT / "tests", timeout=120)


def test_export_loads_in_transformers_with_the_same_logits_and_comes_back_bitwise(tmp_path, capfd):
    m = _model(n_layer=3, n_head=4, n_embd=64, block_size=48)
    save_training(tmp_path / "ck", 7, m)
    r = _cli("export", "--format", "hf", tmp_path / "ck", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["model_type"], cfg["n_positions"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"]) == ("gpt2", 48, 3, 4, 64)
    assert cfg["activation_function"] == "gelu_new" and cfg["vocab_size"] == 256 and cfg["eos_token_id"] < 256
    capfd.readouterr()
    t, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    err = capfd.readouterr().err
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert "newly initialized" not in err and "not used" not in err and "not initialized" not in err, err
    idx = np.random.default_rng(0).integers(0, 256, (2, 48))
    with torch.no_grad():
        theirs = t(torch.tensor(idx)).logits.numpy()
    ours = m.logits(idx)
    assert np.abs(theirs - ours).max() <= 2e-5 * np.abs(ours).max()      # float32 noise
    # ... and back: every tensor bitwise what was exported
    r = _cli("import", "--format", "hf", tmp_path / "hf", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    a, b = Checkpoint(tmp_path / "ck"), Checkpoint(tmp_path / "back")
    model_keys = sorted(k for k in a.tensors if not k.startswith("opt"))
    assert model_keys == sorted(b.tensors)
    for k in model_keys:
        np.testing.assert_array_equal(a.read(k), b.read(k), err_msg=k)
    # a directory saved by transformers itself (its own names and file) imports too
    t.save_pretrained(tmp_path / "saved")
    import_hf(tmp_path / "saved", tmp_path / "back2")
    for k in model_keys:
        np.testing.assert_array_equal(a.read(k), Checkpoint(tmp_path / "back2").read(k), err_msg=k)


def _losses(run):
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_an_imported_model_trains_with_resume(tmp_path):
    """A model that went through transformers (exported, loaded by GPT2LMHeadModel, saved by its own
    save_pretrained, imported back) trains exactly as the original checkpoint does: the same loss at
    every step, bit for bit, and the loss falls. A fresh model of the same shape starts elsewhere, so
    the imported weights are the ones being trained."""
    save_training(tmp_path / "ck", 0, _model(seed=123))       # the tiny preset's shape, not the trainer's init
    export_hf(tmp_path / "ck", tmp_path / "hf")
    transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "saved")
    import_hf(tmp_path / "saved", tmp_path / "imported")
    args = ["-m", "pympar.train", "--preset", "tiny", "--steps", "12", "--sample-tokens", "0", "--eval-every", "0",
            "--dtype", "float32", "--lr", "3e-3", "--warmup", "0"]
    losses = {}
    for name, resume in (("original", ["--resume", tmp_path / "ck"]), ("imported", ["--resume", tmp_path / "imported"]),
                         ("fresh", [])):
        res = run_mpi(1, [*args, *resume, "--out", tmp_path / name], timeout=90)
        assert not resume or "at step 0" in res.stdout, res.stdout[-2000:]
        losses[name] = _losses(tmp_path / name)
    assert len(losses["imported"]) == 12 and losses["imported"] == losses["original"], losses
    assert losses["imported"][0] != losses["fresh"][0], losses
    assert max(losses["imported"][-3:]) < losses["imported"][0] - 0.1, losses["imported"]


def test_what_gpt2_cannot_hold_is_refused_with_the_reason(tmp_path):
    save_training(tmp_path / "moe", 1, _model("moe-tiny"))
    with pytest.raises(CheckpointMismatch, match="GPT-2 has no experts.*--format nanogpt"):
        export_hf(tmp_path / "moe", tmp_path / "x")
    save_training(tmp_path / "ck", 1, _model())
    export_hf(tmp_path / "ck", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "pytorch_model.bin")
    r = _cli("import", "--format", "hf", tmp_path / "hf", tmp_path / "y")
    assert r.returncode == 2 and "pytorch_model.bin is a Python pickle" in r.stderr and "save_pretrained" in r.stderr
    (tmp_path / "hf" / "pytorch_model.bin").rename(tmp_path / "hf" / "model.safetensors")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(cfg, activation_function="gelu")))
    with pytest.raises(CheckpointMismatch, match="tanh form"):
        import_hf(tmp_path / "hf", tmp_path / "z")
