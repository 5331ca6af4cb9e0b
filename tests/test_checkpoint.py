"""Checkpoints in one process: safetensors compatibility, round trips, damaged checkpoints,
keep-last-K, GPT + AdamW resume, export/import with PyTorch, the CLI."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pympar.backend import bfloat16
from pympar.checkpoint import (CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointNotFound, load,
                               resolve, restore_into, save, save_training)
from pympar.checkpoint import safetensors_format as stf
from pympar.checkpoint.convert import export_state_dict, import_state_dict
from pympar.parallel.shard import Shard

ROOT = Path(__file__).resolve().parent.parent


def tensors():
    rng = np.random.default_rng(0)
    return {"w32": rng.standard_normal((6, 4)).astype(np.float32),
            "w64": rng.standard_normal((3, 5)),
            "wbf16": rng.standard_normal((8,)).astype(bfloat16),
            "w16": rng.standard_normal((2, 2, 3)).astype(np.float16),
            "i64": np.arange(5, dtype=np.int64), "scalar": np.array(3.5, np.float32),
            "empty": np.zeros((0, 3), np.float32)}


# --- the file format against the safetensors package -----------------------------------------
def test_our_files_read_by_safetensors_package(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    from safetensors.numpy import load_file
    t = tensors()
    stf.write(tmp_path / "a.safetensors", t, {"k": "v"})
    got = load_file(str(tmp_path / "a.safetensors"))
    assert set(got) == set(t)
    for k in t:
        assert got[k].dtype == t[k].dtype and got[k].shape == t[k].shape, k
        np.testing.assert_array_equal(got[k], t[k])
    with safetensors.safe_open(str(tmp_path / "a.safetensors"), "np") as f:
        assert f.metadata() == {"k": "v"}


def test_package_files_read_by_ours(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file
    t = tensors()
    save_file(t, str(tmp_path / "b.safetensors"), metadata={"x": "1"})
    got, meta = stf.read_all(tmp_path / "b.safetensors")
    assert meta == {"x": "1"}
    for k in t:
        assert got[k].dtype == t[k].dtype
        np.testing.assert_array_equal(got[k], t[k])


def test_bf16_stored_as_BF16(tmp_path):
    stf.write(tmp_path / "c.safetensors", {"a": np.ones(3, bfloat16)})
    header, _, _ = stf.read_header(tmp_path / "c.safetensors")
    assert header["a"]["dtype"] == "BF16"


# --- save / load -------------------------------------------------------------------------------
def test_round_trip_every_dtype(tmp_path):
    t = tensors()
    path = save(tmp_path, 5, {k: (v, None) for k, v in t.items()}, {"m.w32": (t["w32"] * 2, None)},
                meta={"config": {"n_embd": 4}, "data": {"pos": 17}, "loss_scale": 1024.0})
    assert path == tmp_path / "step_00000005"
    assert (tmp_path / "latest").read_text().strip() == "step_00000005"
    want = {k: None for k in t} | {"optim.m.w32": None}
    got, manifest = load(tmp_path, want)
    for k in t:
        assert got[k].dtype == t[k].dtype and got[k].shape == t[k].shape
        np.testing.assert_array_equal(got[k], t[k])
    np.testing.assert_array_equal(got["optim.m.w32"], t["w32"] * 2)
    assert manifest["step"] == 5 and manifest["meta"]["data"] == {"pos": 17}
    rec = manifest["files"]["rank_00000.safetensors"]
    assert rec["sha256"] == stf.sha256_file(path / "rank_00000.safetensors")


def test_load_part_and_union_shards(tmp_path):
    full = np.arange(36, dtype=np.float32).reshape(9, 4)
    qkv = Shard((9, 4), ((slice(0, 1), slice(3, 4), slice(6, 7)),))   # one row of each of q, k, v
    rest = Shard((9, 4), ((slice(1, 3), slice(4, 6), slice(7, 9)),))
    save(tmp_path, 1, {"w": (qkv.take(full), qkv)}, {})
    save(tmp_path / "b", 1, {"w": (rest.take(full), rest)}, {})
    got, _ = load(tmp_path, {"w": ((9, 4), ((slice(0, 1), slice(6, 7)), slice(1, 3)))})
    np.testing.assert_array_equal(got["w"], full[[0, 6]][:, 1:3])
    got, _ = load(tmp_path / "b", {"w": rest})
    np.testing.assert_array_equal(got["w"], rest.take(full))


def test_keep_last_k(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, {"w": (np.full(3, step, np.float32), None)}, {}, keep=2)
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert kept == ["step_00000004", "step_00000005"]
    got, m = load(tmp_path, {"w": None})
    assert m["step"] == 5 and got["w"][0] == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temporary leftovers


def test_save_same_step_again_replaces(tmp_path):
    save(tmp_path, 2, {"w": (np.zeros(2, np.float32), None)}, {})
    save(tmp_path, 2, {"w": (np.ones(2, np.float32), None)}, {})
    np.testing.assert_array_equal(load(tmp_path, {"w": None})[0]["w"], np.ones(2))


def test_shape_that_does_not_match_its_shard_is_refused(tmp_path):
    with pytest.raises(Exception, match=r"w: array shape \(3,\) does not match"):
        save(tmp_path, 1, {"w": (np.zeros(3, np.float32), Shard((8,), (slice(0, 4),)))}, {})


def test_meta_that_is_not_json_fails_as_a_checkpoint_error(tmp_path):
    """Rank 0's manifest write fails: a CheckpointError every rank agrees on (a bare TypeError on
    rank 0 alone would leave the other ranks waiting); the previous checkpoint stays latest."""
    save(tmp_path, 1, {"w": (np.zeros(2, np.float32), None)}, {})
    with pytest.raises(CheckpointError, match="publishing the checkpoint failed.*JSON serializable"):
        save(tmp_path, 2, {"w": (np.ones(2, np.float32), None)}, {}, meta={"bad": object()})
    arrays, manifest = load(tmp_path, {"w": None})
    assert manifest["step"] == 1 and arrays["w"].tolist() == [0.0, 0.0]


# --- damaged checkpoints: each names the file and the problem ----------------------------------
@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "run"
    t = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float32)}
    save(d, 1, {"a": (t["a"], None)}, {}, meta={"config": {"n_embd": 4, "n_layer": 1}})
    save(d, 2, {k: (v, None) for k, v in t.items()}, {}, meta={"config": {"n_embd": 4, "n_layer": 1}})
    return d, d / "step_00000002" / "rank_00000.safetensors"


def test_missing_shard_file(ckpt):
    d, f = ckpt
    f.unlink()
    with pytest.raises(CheckpointCorrupt, match="rank_00000.safetensors: missing shard file"):
        load(d, {"a": None})


def test_truncated_shard_file(ckpt):
    d, f = ckpt
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    with pytest.raises(CheckpointCorrupt, match=r"rank_00000.safetensors: truncated: \d+ bytes, the manifest records"):
        load(d, {"a": None})


def test_checksum_mismatch(ckpt):
    d, f = ckpt
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="rank_00000.safetensors: checksum mismatch"):
        load(d, {"b": None})


def test_manifest_of_another_model(ckpt):
    d, _ = ckpt
    with pytest.raises(CheckpointMismatch, match=r"manifest.json: checkpoint is of another model \(n_layer: checkpoint 1, model 2\)"):
        load(d, {"a": None}, expect_config={"n_embd": 4, "n_layer": 2})
    with pytest.raises(CheckpointMismatch, match=r"manifest.json: tensor 'a' has full shape \(3, 4\) .* wants \(4, 4\)"):
        load(d, {"a": ((4, 4), ())})
    with pytest.raises(CheckpointMismatch, match="manifest.json: tensor 'c' is not in the checkpoint"):
        load(d, {"c": None})


def test_range_not_covered(tmp_path):
    sh = Shard((8, 2), (slice(0, 4),))
    save(tmp_path, 1, {"w": (np.zeros((4, 2), np.float32), sh)}, {})
    with pytest.raises(CheckpointMismatch, match=r"manifest.json: tensor 'w': the stored pieces do not cover .* \(4 of 8 elements missing\)"):
        load(tmp_path, {"w": ((8, 2), (slice(2, 6),))})


def test_resume_dir_does_not_exist(tmp_path):
    with pytest.raises(CheckpointNotFound, match="nope: does not exist .expected a run directory, its "
                                                 "checkpoints/ folder or one step_N checkpoint"):
        load(tmp_path / "nope", {})
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFound, match=r"empty: not a checkpoint: looked for .*empty/manifest.json "
                                                 r"\(one checkpoint\), .*empty/latest \(a checkpoints folder\) and "
                                                 r".*empty/checkpoints/latest \(a run directory"):
        load(tmp_path / "empty", {})
    (tmp_path / "empty" / "checkpoints" / "step_00000007").mkdir(parents=True)   # no latest, no manifest
    with pytest.raises(CheckpointNotFound, match=r"found none \(there are step_00000007: pass one of them\)"):
        load(tmp_path / "empty", {})


def test_a_run_directory_its_checkpoints_folder_and_one_step_all_resolve(ckpt, tmp_path):
    d, _ = ckpt                       # d: a checkpoints folder (step_1, step_2, latest -> step_2)
    run = tmp_path / "out"
    run.mkdir()
    (run / "checkpoints").symlink_to(d, target_is_directory=True)    # the trainer's --out layout
    want = (d / "step_00000002").resolve()
    for form in (run, run / "checkpoints", d / "step_00000002"):
        assert resolve(form).resolve() == want, form
        got, m = load(form, {"a": None})
        assert m["step"] == 2
    assert resolve(d / "step_00000001").resolve() == (d / "step_00000001").resolve()


def test_latest_points_nowhere(ckpt):
    d, _ = ckpt
    (d / "latest").write_text("step_00000099\n")
    with pytest.raises(CheckpointNotFound, match="latest: points to step_00000099, which has no manifest.json"):
        load(d, {"a": None})


def test_unreadable_manifest(ckpt):
    d, _ = ckpt
    (d / "step_00000002" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointCorrupt, match="manifest.json: unreadable manifest"):
        load(d, {"a": None})


def test_damage_in_unread_file_does_not_matter(ckpt):
    d, _ = ckpt   # step 1 stays whole whatever happens to step 2
    (d / "step_00000002" / "rank_00000.safetensors").unlink()
    got, m = load(d / "step_00000001", {"a": None})
    assert m["step"] == 1 and got["a"].shape == (3, 4)


# --- GPT + AdamW: resume continues the same numbers -------------------------------------------
def _train(model, opt, batches):
    losses = []
    for idx in batches:
        model.zero_grad()
        losses.append(model.loss_and_grad(idx, np.roll(idx, -1, axis=1)))
        opt.step()
    return losses


@pytest.mark.parametrize("preset", ["tiny", "moe-tiny"])
def test_gpt_resume_is_bitwise(tmp_path, preset):
    from pympar.nn.config import GPTConfig
    from pympar.nn.gpt import GPT
    from pympar.optim.adamw import AdamW
    cfg = GPTConfig.from_preset(preset, block_size=16)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, cfg.vocab_size, (2, 16)) for _ in range(4)]
    m1 = GPT(cfg, seed=3)
    o1 = AdamW(m1.named_parameters(), lr=1e-2)
    ref = _train(m1, o1, batches)

    m2 = GPT(cfg, seed=3)
    o2 = AdamW(m2.named_parameters(), lr=1e-2)
    _train(m2, o2, batches[:2])
    save_training(tmp_path, 2, m2, o2, meta={"data": {"step": 2}})
    m3 = GPT(cfg, seed=99)                         # different numbers until restored
    o3 = AdamW(m3.named_parameters(), lr=1e-2)
    manifest = restore_into(m3, o3, tmp_path)
    assert manifest["step"] == 2 and o3.step_count == 2
    assert _train(m3, o3, batches[2:]) == ref[2:]


def test_restore_refuses_another_model(tmp_path):
    from pympar.nn.config import GPTConfig
    from pympar.nn.gpt import GPT
    save_training(tmp_path, 1, GPT(GPTConfig.from_preset("tiny")))
    with pytest.raises(CheckpointMismatch, match=r"another model \(n_head: checkpoint 2, model 4\)"):
        restore_into(GPT(GPTConfig.from_preset("tiny", n_head=4)), None, tmp_path)


# --- export / import, PyTorch as the oracle ----------------------------------------------------
def test_export_loads_in_pytorch_and_imports_back(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from pympar.nn.config import GPTConfig
    from pympar.nn.gpt import GPT
    cfg = GPTConfig.from_preset("tiny")
    m = GPT(cfg, seed=5)
    # the checkpoint holds wte sharded over two "ranks" (two saves, as two ranks would write)
    save_training(tmp_path / "ck", 4, m)
    export_state_dict(tmp_path / "ck", tmp_path / "model.safetensors")
    sd = load_file(str(tmp_path / "model.safetensors"))
    ref = m.state_dict()
    assert set(sd) == set(ref) | {"lm_head.weight"}
    for k, v in ref.items():
        assert sd[k].dtype == torch.float32
        np.testing.assert_array_equal(sd[k].numpy(), v)
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    # a file written by PyTorch (bf16) comes back in as a step-0 checkpoint
    from safetensors.torch import save_file
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(tmp_path / "bf16.safetensors"))
    import_state_dict(tmp_path / "bf16.safetensors", tmp_path / "imp", n_head=cfg.n_head)
    m2 = GPT(cfg, seed=0)
    assert restore_into(m2, None, tmp_path / "imp")["step"] == 0
    for k, v in m2.state_dict().items():
        np.testing.assert_array_equal(v, sd[k].to(torch.bfloat16).float().numpy())


def test_import_checks_the_state_dict(tmp_path):
    stf.write(tmp_path / "x.safetensors", {"transformer.wte.weight": np.zeros((4, 2), np.float32)})
    with pytest.raises(ValueError, match="wpe"):
        import_state_dict(tmp_path / "x.safetensors", tmp_path / "d", n_head=1)
    from pympar.nn.config import GPTConfig
    from pympar.nn.gpt import GPT
    sd = GPT(GPTConfig.from_preset("tiny")).state_dict()
    sd.pop("transformer.h.1.mlp.c_fc.bias")
    stf.write(tmp_path / "y.safetensors", sd)
    with pytest.raises(CheckpointMismatch, match=r"y.safetensors: does not match config .* missing \['transformer.h.1.mlp.c_fc.bias'\]"):
        import_state_dict(tmp_path / "y.safetensors", tmp_path / "d", n_head=2)


def test_cli_export_inspect_import(tmp_path):
    from pympar.nn.config import GPTConfig
    from pympar.nn.gpt import GPT
    save_training(tmp_path / "ck", 3, GPT(GPTConfig.from_preset("moe-tiny")))
    env = dict(os.environ)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pympar.checkpoint", *map(str, args)], env=env,
                              capture_output=True, text=True, timeout=60)
    r = cli("inspect", tmp_path / "ck", "--verify")
    assert r.returncode == 0, r.stderr
    assert "step 3" in r.stdout and "transformer.h.1.moe.router.weight" in r.stdout and " ok" in r.stdout
    assert cli("export", tmp_path / "ck", tmp_path / "m.safetensors").returncode == 0
    r = cli("import", tmp_path / "m.safetensors", tmp_path / "ck2")
    assert r.returncode == 0, r.stderr
    a, _ = stf.read_all(tmp_path / "m.safetensors")
    got, m = load(tmp_path / "ck2", {k: None for k in a if k != "lm_head.weight"})
    assert m["meta"]["config"]["n_expert"] == 4
    for k, v in got.items():
        np.testing.assert_array_equal(v, a[k])
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / ".gitkeep").write_text("")         # hidden files do not count
    assert cli("import", tmp_path / "m.safetensors", tmp_path / "hidden").returncode == 0
    before = (tmp_path / "ck" / "latest").read_bytes()       # never over a folder that holds something
    for args, want in (((tmp_path / "ck",), "already holds latest, step_00000003: import writes"),
                       ((tmp_path / "new", "--step", "-5"), "--step -5 must be >= 0"),
                       ((tmp_path / "new", "--n-head", "3"), "records n_head=2 (pympar metadata); --n-head 3"),
                       ((tmp_path / "new", "--config", '{"nonsense": 1}'), "--config: nonsense is not a GPTConfig"),
                       ((tmp_path / "new", "--config", "{bad"), "--config '{bad': not JSON")):
        r = cli("import", tmp_path / "m.safetensors", *args)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert (tmp_path / "ck" / "latest").read_bytes() == before and not (tmp_path / "new").exists()
    f = tmp_path / "ck" / "step_00000003" / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    r = cli("inspect", tmp_path / "ck", "--verify")
    assert r.returncode == 1 and "DAMAGED: truncated" in r.stdout
    r = cli("export", tmp_path / "nothing", tmp_path / "z.safetensors")
    assert r.returncode == 2 and "does not exist (expected a run directory" in r.stderr
