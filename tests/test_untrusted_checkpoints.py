"""Checkpoints from untrusted hands (issue 49, in part): a manifest or a ``latest`` pointer that names a
file outside the checkpoint's folder, a shard that is a link out of it, and manifest fields of the wrong
type are refused by every tool with one line naming the file and exit 2 -- never followed, never a
traceback. The crafted checkpoints are made here from a real one, not checked in."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pympar.checkpoint import Checkpoint, CheckpointError
from pympar.checkpoint.state import save_training
from pympar.nn import GPT, GPTConfig

CFG = dict(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)   # the default corpus: bytes


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good") / "ck"
    save_training(root, 3, GPT(GPTConfig(**CFG)))
    return root


def _copy(good, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(good, dst)
    return dst, dst / "step_00000003"


def _edit_manifest(step_dir, fn):
    mf = step_dir / "manifest.json"
    m = json.loads(mf.read_text())
    fn(m)
    mf.write_text(json.dumps(m))


def _tools(ck, tmp_path):
    """(name, argv) of every tool that reads a checkpoint: export (reads every tensor), the trainer's
    resume (checks the manifest before any collective) and generate."""
    py = sys.executable
    return [("export", [py, "-m", "pympar.checkpoint", "export", str(ck), str(tmp_path / "out.safetensors")]),
            ("train --resume", [py, "-m", "pympar.train", "--resume", str(ck), "--steps", "4",
                                *[f"--{k.replace('_', '-')}={v}" for k, v in CFG.items()], "--dtype", "float32",
                                "--eval-iters", "1", "--sample-tokens", "0", "--out", str(tmp_path / "run")]),
            ("generate", [py, "-m", "pympar.generate", str(ck), "--tokens", "4", "--prompt-ids", "1,2"])]


def _refused(ck, tmp_path, what):
    for name, argv in _tools(ck, tmp_path):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        text = r.stdout + r.stderr
        assert r.returncode == 2, (name, what, text[-2000:])
        assert "Traceback" not in text, (name, what, text[-2000:])
        errors = [x for x in text.splitlines() if "error" in x]
        assert len(errors) == 1 and what in errors[0], (name, errors)


@pytest.mark.parametrize("name", ["../outside/rank_00000.safetensors", "ABSOLUTE", "sub/rank_00000.safetensors"])
def test_a_piece_named_outside_the_folder_is_refused(good, tmp_path, name):
    ck, step = _copy(good, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(step / "rank_00000.safetensors", outside / "rank_00000.safetensors")
    name = str(outside / "rank_00000.safetensors") if name == "ABSOLUTE" else name

    def move(m):
        rec = m["files"].pop("rank_00000.safetensors")
        m["files"][name] = rec
        for t in m["tensors"].values():
            for q in t["pieces"]:
                q["file"] = name
    _edit_manifest(step, move)
    with pytest.raises(CheckpointError, match="outside the checkpoint's folder"):
        ck_ = Checkpoint(ck)
        ck_.read(next(iter(ck_.tensors)))
    _refused(ck, tmp_path, "outside the checkpoint's folder")


def test_a_shard_that_links_out_is_not_followed(good, tmp_path):
    ck, step = _copy(good, tmp_path)
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(step / "rank_00000.safetensors", elsewhere)
    os.symlink(elsewhere, step / "rank_00000.safetensors")
    _refused(ck, tmp_path, "outside the checkpoint's folder")


@pytest.mark.parametrize("pointer", ["../other/step_00000003", "ABSOLUTE", "step_00000003/../../other/step_00000003"])
def test_a_latest_pointer_out_of_its_folder_is_refused(good, tmp_path, pointer):
    ck, _ = _copy(good, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(good, other)                     # a valid checkpoint, elsewhere: never to be loaded
    (ck / "latest").write_text(str(other / "step_00000003") if pointer == "ABSOLUTE" else pointer)
    _refused(ck, tmp_path, "does not name a step_N checkpoint")


@pytest.mark.parametrize("field, value", [("meta", "a string"), ("files", []), ("files", None), ("tensors", []),
                                          ("step", "x"), ("step", -5), ("bytes", "12")])
def test_manifest_fields_of_the_wrong_type_are_named(good, tmp_path, field, value):
    ck, step = _copy(good, tmp_path)

    def edit(m):
        if field == "bytes":
            next(iter(m["files"].values()))["bytes"] = value
        elif value is None:
            del m[field]
        else:
            m[field] = value
    _edit_manifest(step, edit)
    _refused(ck, tmp_path, "field")


def test_a_huge_manifest_is_not_read(good, tmp_path):
    """A sparse 8 GiB manifest: refused by its size, before a byte of it is read."""
    ck, step = _copy(good, tmp_path)
    with open(step / "manifest.json", "r+b") as f:
        f.truncate(8 << 30)
    with pytest.raises(CheckpointError, match="larger than any manifest"):
        Checkpoint(ck)


def _safetensors(path, header_obj=None, raw=None, data=b""):
    import struct
    raw = raw if raw is not None else json.dumps(header_obj).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("case", ["nested", "list", "number entry", "string offsets", "float offsets",
                                  "negative offsets", "shape 2^64", "offsets past the end", "unknown dtype"])
def test_a_hostile_safetensors_header_is_one_named_error(tmp_path, case):
    """Every field checked against the file's real size before anything is allocated from it; a header
    nested 100,000 deep, a list, a number, offsets that are strings, floats or negative, a shape of
    [2^64] or an unknown dtype: CheckpointCorrupt naming the file, not a RecursionError, TypeError,
    KeyError or OverflowError."""
    from pympar.checkpoint import safetensors_format as stf
    f = tmp_path / "x.safetensors"
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    headers = {"nested": None, "list": [1, 2], "number entry": {"w": 3},
               "string offsets": {"w": dict(entry, data_offsets=["0", "8"])},
               "float offsets": {"w": dict(entry, data_offsets=[0.0, 8.0])},
               "negative offsets": {"w": dict(entry, data_offsets=[-8, 0])},
               "shape 2^64": {"w": dict(entry, shape=[2 ** 64], data_offsets=[0, 8])},
               "offsets past the end": {"w": dict(entry, shape=[1000], data_offsets=[0, 4000])},
               "unknown dtype": {"w": dict(entry, dtype="F128")}}
    if case == "nested":
        _safetensors(f, raw=b"[" * 100_000 + b"]" * 100_000, data=bytes(8))
    else:
        _safetensors(f, headers[case], data=bytes(8))
    with pytest.raises(CheckpointError) as e:
        stf.read_header(f)
    assert str(f) in str(e.value)


def test_a_header_dtype_the_manifest_does_not_say_is_refused(good, tmp_path):
    """A shard whose header stores a tensor as another dtype than the manifest records: refused, not cast."""
    ck, step = _copy(good, tmp_path)
    _edit_manifest(step, lambda m: next(iter(m["tensors"].values())).__setitem__("dtype", "F64"))
    ck_ = Checkpoint(ck, verify=False)
    with pytest.raises(CheckpointError, match="the manifest says F64"):
        ck_.read(next(iter(ck_.tensors)))


@pytest.mark.parametrize("field, value, said", [("next_step", "x", "meta.next_step"), ("next_step", -5, "meta.next_step"),
                                                ("next_step", 10 ** 9, "beyond --steps"),
                                                ("optimizer", {"step": "x"}, "meta.optimizer.step"),
                                                ("config", "not an object", "meta.config")])
def test_the_trainers_fields_are_checked_before_a_resume(good, tmp_path, field, value, said):
    """A next_step of 10^9 "resumed" and trained nothing with exit 0; "x" and -5 raised deep inside: each is
    one line and exit 2 before any collective."""
    ck, step = _copy(good, tmp_path)
    _edit_manifest(step, lambda m: m["meta"].__setitem__(field, value))
    name, argv = _tools(ck, tmp_path)[1]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and said in r.stderr, r.stderr[-2000:]
