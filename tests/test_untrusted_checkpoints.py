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

import numpy as np
import pytest

from mpirun import PEAK_WRAPPER, peaks_kib

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


_PROG = {"export": "pympar.checkpoint", "train --resume": "pympar.train", "generate": "pympar.generate"}


# Runs a tool's module under an audit hook (PEP 578) that reports every file the process opens below
# BAIT: the decoys a hostile checkpoint points at must never be opened, not merely refused afterwards.
_AUDITED = """
import os, runpy, sys
bait = os.environ['PYMPAR_TEST_BAIT']
def hook(event, args):
    if event == 'open' and isinstance(args[0], (str, bytes, os.PathLike)):
        p = os.fsdecode(args[0])
        if os.path.realpath(p).startswith(bait):
            os.write(2, ('OPENED-BAIT ' + p + '\\n').encode())
sys.addaudithook(hook)
mod = sys.argv[1]
sys.argv = [mod] + sys.argv[2:]
runpy.run_module(mod, run_name='__main__', alter_sys=True)
"""


def _refused(ck, tmp_path, what, bait=None):
    """Every tool refuses ``ck``: exit 2, one error line saying ``what``, no traceback; none opens a file
    under ``bait`` (the decoy folder a hostile checkpoint points at)."""
    for name, argv in _tools(ck, tmp_path):
        if bait is not None:                   # python -m MOD ARGS -> python -c AUDITED MOD ARGS
            argv = [argv[0], "-c", _AUDITED, *argv[2:]]
        env = dict(os.environ, PYMPAR_TEST_BAIT=os.path.realpath(bait) if bait else "")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        text = r.stdout + r.stderr
        assert r.returncode == 2, (name, what, text[-2000:])
        assert "Traceback" not in text and "OPENED-BAIT" not in text, (name, what, text[-2000:])
        errors = [x for x in text.splitlines() if "error" in x]
        assert len(errors) == 1 and what in errors[0], (name, errors)
        assert errors[0].startswith(f"{_PROG[name]}: error: "), (name, errors)   # the tool's name, then the line


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
    _refused(ck, tmp_path, "outside the checkpoint's folder", bait=outside)


def test_a_shard_that_links_out_is_not_followed(good, tmp_path):
    ck, step = _copy(good, tmp_path)
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(step / "rank_00000.safetensors", elsewhere)
    os.symlink(elsewhere, step / "rank_00000.safetensors")
    _refused(ck, tmp_path, "outside the checkpoint's folder", bait=elsewhere)


def test_a_manifest_that_links_out_is_not_read(good, tmp_path):
    """A manifest.json that is a link to another folder's manifest: refused before it is read (the other
    folder's shards would be named by it, read through a manifest that is not this checkpoint's)."""
    ck, step = _copy(good, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(step, other)
    (step / "manifest.json").unlink()
    os.symlink(other / "manifest.json", step / "manifest.json")
    _refused(ck, tmp_path, "is a link out of the checkpoint's folder", bait=other / "manifest.json")


@pytest.mark.parametrize("pointer", ["../other/step_00000003", "ABSOLUTE", "step_00000003/../../other/step_00000003"])
def test_a_latest_pointer_out_of_its_folder_is_refused(good, tmp_path, pointer):
    ck, _ = _copy(good, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(good, other)                     # a valid checkpoint, elsewhere: never to be loaded
    (ck / "latest").write_text(str(other / "step_00000003") if pointer == "ABSOLUTE" else pointer)
    _refused(ck, tmp_path, "does not name a step_N checkpoint", bait=other)


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
                                                # a negative step wrote NaN weights on the first update
                                                ("optimizer", {"step": -1}, "meta.optimizer.step"),
                                                ("guard", {"consecutive": "x"}, "meta.guard"),
                                                ("guard", [1], "meta.guard"),
                                                ("loss_scaler", {"scale": 0, "good_steps": 0}, "meta.loss_scaler"),
                                                # an infinite scale skipped every step and exited 0
                                                ("loss_scaler", {"scale": 1e400, "good_steps": 0}, "meta.loss_scaler"),
                                                ("loss_scaler", {"x": 1}, "meta.loss_scaler"),
                                                ("config", "not an object", "meta.config")])
def test_the_trainers_fields_are_checked_before_a_resume(good, tmp_path, field, value, said):
    """A next_step of 10^9 "resumed" and trained nothing with exit 0; "x" and -5 raised deep inside: each is
    one line and exit 2 before any collective."""
    ck, step = _copy(good, tmp_path)
    _edit_manifest(step, lambda m: m["meta"].__setitem__(field, value))
    name, argv = _tools(ck, tmp_path)[1]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and said in r.stderr, r.stderr[-2000:]


# --- memory that follows what a file holds, not what it claims -------------------------------------

def _run_peak(argv, cwd):
    """(exit status, output, peak resident MiB of the command alone), through mpirun's PEAK_WRAPPER."""
    r = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, *argv], capture_output=True, text=True, timeout=120,
                       cwd=cwd)
    text, (peak,) = peaks_kib(r.stdout)
    return r.returncode, text + r.stderr, peak / 1024


PEAK_MIB = 400     # the tools' own footprint is ~100-150 MiB (Python, NumPy, the native kernels); the claims
#                    below would allocate 1-2 GiB each


def test_weight_elements_bounds_the_parameter_count_from_below():
    """The bound the loaders use: every config's weight matrices are at most its parameters (else a real
    checkpoint would be refused) and at least 90% of them at these sizes (else the bound guards nothing)."""
    from pympar.nn.config import weight_elements
    for cfg in [GPTConfig(**CFG), GPTConfig.from_preset("small"), GPTConfig.from_preset("moe-small"),
                GPTConfig.from_preset("moe-tiny", shared_expert=True, bias=False, n_embd=64)]:
        n = sum(int(p.size) for p in GPT(cfg).state_dict().values())
        assert 0.9 * n <= weight_elements(cfg) <= n, (cfg, weight_elements(cfg), n)


def test_a_config_claiming_a_large_model_is_refused_before_it_is_built(good, tmp_path):
    """A small checkpoint whose config claims a 2^20 x 512 vocabulary: generate allocated 2.1 GB before any
    check. Refused from what the checkpoint holds, within PEAK_MIB."""
    ck, step = _copy(good, tmp_path)
    _edit_manifest(step, lambda m: m["meta"]["config"].update(vocab_size=2 ** 20, n_embd=512, n_head=8))
    rc, text, peak = _run_peak(_tools(ck, tmp_path)[2][1], tmp_path)
    assert rc == 2 and "Traceback" not in text and "needs at least" in text, text[-2000:]
    assert peak < PEAK_MIB, peak


def test_tensor_shapes_claiming_more_than_the_files_hold_are_refused(good, tmp_path):
    """A manifest whose full shapes claim more bytes than its files hold (each element is stored at least
    once): refused by every tool before anything is allocated from the shapes."""
    ck, step = _copy(good, tmp_path)
    _edit_manifest(step, lambda m: m["tensors"]["transformer.wte.weight"].update(full_shape=[2 ** 24, 16]))
    _refused(ck, tmp_path, "but its files hold")
    rc, text, peak = _run_peak(_tools(ck, tmp_path)[0][1], tmp_path)    # export allocated the claimed 1 GiB
    assert rc == 2 and peak < PEAK_MIB, (peak, text[-2000:])


def _nanogpt_file(good, tmp_path, metadata=None, extra=None):
    """A real export of the good checkpoint, its metadata replaced, plus ``extra`` raw tensors."""
    from pympar.checkpoint import safetensors_format as stf
    from pympar.checkpoint.convert import export_state_dict
    f = tmp_path / "m.safetensors"
    export_state_dict(good, f)
    tensors, meta = stf.read_all(f)
    stf.write(f, tensors, metadata if metadata is not None else meta)
    if extra is not None:                         # appended as a sparse tensor: a header entry, no data written
        import struct
        n = struct.unpack("<Q", f.read_bytes()[:8])[0]
        header = json.loads(f.read_bytes()[8:8 + n])
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        header["junk"] = {"dtype": "F32", "shape": [extra // 4], "data_offsets": [end, end + extra]}
        data = f.read_bytes()[8 + n:]
        _safetensors(f, header, data=data)
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size + extra)
    return f


def _import(f, tmp_path, *extra):
    return [sys.executable, "-m", "pympar.checkpoint", "import", str(f), str(tmp_path / "imported"), *extra]


@pytest.mark.parametrize("meta, said", [({"pympar.config": "[1, 2]"}, "metadata 'pympar.config'"),
                                        ({"pympar.config": "{"}, "metadata 'pympar.config'"),
                                        ({"pympar.config": json.dumps(dict(CFG, vocab_size=2 ** 20, n_embd=512,
                                                                           n_head=8))}, "needs at least")])
def test_import_metadata_is_checked_before_a_model_is_built(good, tmp_path, meta, said):
    """Import metadata whose config is not an object, or claims a model far larger than the file (a 178 KB
    file reached 4.2 GB): one line, exit 2, within PEAK_MIB."""
    f = _nanogpt_file(good, tmp_path, meta)
    rc, text, peak = _run_peak(_import(f, tmp_path), tmp_path)
    assert rc == 2 and "Traceback" not in text and said in text, text[-2000:]
    assert peak < PEAK_MIB, peak


def test_import_does_not_copy_a_sparse_tensor(good, tmp_path):
    """A 1 GiB tensor that is a hole in a sparse file: import read (copied) every tensor before checking the
    names; now it maps them, refuses the unexpected one, and stays within PEAK_MIB."""
    f = _nanogpt_file(good, tmp_path, extra=1 << 30)
    rc, text, peak = _run_peak(_import(f, tmp_path, "--n-head", "2"), tmp_path)
    assert rc == 2 and "Traceback" not in text and "unexpected ['junk']" in text, text[-2000:]
    assert peak < PEAK_MIB, peak


@pytest.mark.parametrize("config, said", [("[1]", "expected a JSON object"), ('{"model_type": "gpt2"}', "'vocab_size'"),
                                          ("{", "unreadable"), ('{"model_type": "gpt2", "vocab_size": "x"}', "'vocab_size'")])
def test_a_hugging_face_config_is_checked(good, tmp_path, config, said):
    """config.json from untrusted hands: a list, missing or non-integer sizes, broken JSON: one line naming
    the file and the field (a KeyError, TypeError or AttributeError before)."""
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(config)
    shutil.copy(_nanogpt_file(good, tmp_path), src / "model.safetensors")
    r = subprocess.run(_import(src, tmp_path, "--format", "hf"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and said in r.stderr and "config.json" in r.stderr, r.stderr


def test_an_unwritable_import_destination_is_one_line(good, tmp_path):
    """An output folder that cannot be made (its parent is a file): one line, exit 2, no traceback."""
    f = _nanogpt_file(good, tmp_path)
    (tmp_path / "a_file").write_text("")
    r = subprocess.run([sys.executable, "-m", "pympar.checkpoint", "import", str(f), str(tmp_path / "a_file" / "ck"),
                        "--n-head", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "a_file" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("pympar.checkpoint: error: "), r.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["a piece outside", "a field of the wrong type", "a piece index of strings",
                                  "a config claiming a large model", "a hostile header"])
def test_on_two_ranks_every_rank_says_the_same_line_and_nothing_aborts(good, tmp_path, case):
    """Under mpiexec the same refusal on every rank, before any collective: exit 2, one line per rank with
    the same text, no traceback, no MPI_Abort -- for the trainer's resume and for generate on a layout."""
    from mpirun import run_mpi
    ck, step = _copy(good, tmp_path)
    shard = step / "rank_00000.safetensors"
    if case == "a piece outside":
        def edit(m):
            m["files"]["../x.safetensors"] = m["files"].pop("rank_00000.safetensors")
            for t in m["tensors"].values():
                for q in t["pieces"]:
                    q["file"] = "../x.safetensors"
        _edit_manifest(step, edit)
    elif case == "a field of the wrong type":
        _edit_manifest(step, lambda m: m.__setitem__("tensors", []))
    elif case == "a piece index of strings":
        _edit_manifest(step, lambda m: m["tensors"]["transformer.h.0.attn.c_attn.weight"]["pieces"][0]
                       .__setitem__("index", [[["a", "b"]], [[0, 16]]]))
    elif case == "a config claiming a large model":
        _edit_manifest(step, lambda m: m["meta"]["config"].update(vocab_size=2 ** 20, n_embd=512, n_head=8))
    else:
        raw = shard.read_bytes()
        _safetensors(shard, raw=b"[" * 100_000 + b"]" * 100_000, data=raw[-64:])
    for name, argv in _tools(ck, tmp_path)[1:]:
        r = run_mpi(2, argv[1:], timeout=120, cwd=tmp_path, check=False)
        errors = [x.split(": error", 1)[1].replace("(rank 1)", "(rank 0)") for x in r.stdout.splitlines()
                  if ": error" in x]
        assert r.returncode == 2, (name, case, r.stdout[-3000:])
        assert len(errors) == 2 and errors[0] == errors[1], (name, case, r.stdout[-3000:])
        assert "Traceback" not in r.stdout and "MPI_Abort" not in r.stdout and "BAD TERMINATION" not in r.stdout


# --- a piece's index, the ranks and world_size: checked before anything is built from them -----------

WTE = "transformer.wte.weight"       # CFG: full shape [256, 16]


def _set_index(index, key=WTE):
    return lambda m: m["tensors"][key]["pieces"][0].__setitem__("index", index)


@pytest.mark.parametrize("case, index", [
    ("a number", [5]), ("null", [None]), ("strings", [[["a", "b"]], [[0, 16]]]),
    ("floats", [[[0.0, 256.0]], [[0.0, 16.0]]]), ("a step", [[[0, 256, 2]], [[0, 16]]]),
    ("booleans", [[[False, True]], [[0, 16]]]), ("three dimensions", [[[0, 256]], [[0, 16]], [[0, 1]]]),
    ("one dimension", [[[0, 256]]]), ("no block", [[], [[0, 16]]]), ("overlapping", [[[0, 200], [100, 256]], [[0, 16]]]),
    ("out of order", [[[128, 256], [0, 128]], [[0, 16]]]), ("past the end", [[[0, 300]], [[0, 16]]]),
    ("negative", [[[-1, 256]], [[0, 16]]]), ("repeated", [[[0, 1]] * 300, [[0, 1]] * 20])])
def test_a_piece_index_that_is_not_ordered_blocks_inside_the_shape_is_named(good, tmp_path, case, index):
    """A piece's index from untrusted hands: a number, null, strings or floats gave a TypeError, a step or a
    third dimension a ValueError traceback; one dimension short, blocks out of order or past the end were
    loaded (into the wrong places); overlapping or repeated blocks are how a small manifest made Shard.pieces()
    build 4e8 tuples. Every tool: one line naming the field, exit 2."""
    ck, step = _copy(good, tmp_path)
    _edit_manifest(step, _set_index(index))
    _refused(ck, tmp_path, f"'tensors.{WTE}.pieces[0].index'")


def test_blocks_that_repeat_without_limit_are_refused_before_they_are_expanded(good, tmp_path):
    """2,000 x 2,000 repeated [0, 1] blocks (a 32 KB manifest): export expanded them into 4e6 rectangles
    before reading one; the 20,000 x 20,000 of the audit (330 KB) ran a minute into a MemoryError. Refused
    from the manifest, within PEAK_MIB."""
    ck, step = _copy(good, tmp_path)
    _edit_manifest(step, _set_index([[[0, 1]] * 2000, [[0, 1]] * 2000]))
    assert (step / "manifest.json").stat().st_size < 64_000
    rc, text, peak = _run_peak(_tools(ck, tmp_path)[0][1], tmp_path)
    assert rc == 2 and "Traceback" not in text and "pieces[0].index" in text, text[-2000:]
    assert peak < PEAK_MIB, peak


def test_an_index_of_one_block_a_row_is_read(good, tmp_path):
    """The check refuses no index a layout may write, up to as many blocks as the dimension is long: wte's
    piece given as 256 one-row blocks by 16 one-column blocks (the same elements in the same order as
    [[0, 256]], [[0, 16]]) exports the same numbers."""
    from pympar.checkpoint import safetensors_format as stf
    ck, step = _copy(good, tmp_path)
    _edit_manifest(step, _set_index([[[r, r + 1] for r in range(256)], [[c, c + 1] for c in range(16)]]))
    r = subprocess.run(_tools(ck, tmp_path)[0][1], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    got, _ = stf.read_all(tmp_path / "out.safetensors")
    np.testing.assert_array_equal(got[WTE], Checkpoint(good).read(WTE))


def test_a_piece_of_more_rectangles_than_any_layout_writes_is_refused(tmp_path):
    """Blocks in order inside the shape still multiply: one-row by one-column blocks make a piece of as many
    rectangles as elements, which read() handles one by one (a large model's: millions, gigabytes of tuples).
    A (1024, 128) embedding so cut -- 131,072 rectangles, over MAX_PIECE_RECTANGLES -- is refused by the
    manifest check, before anything is expanded."""
    from pympar.checkpoint.loading import MAX_PIECE_RECTANGLES
    save_training(tmp_path / "ck", 3, GPT(GPTConfig(**dict(CFG, vocab_size=1024, n_embd=128))))
    step = tmp_path / "ck" / "step_00000003"
    assert 1024 * 128 > MAX_PIECE_RECTANGLES
    _edit_manifest(step, _set_index([[[r, r + 1] for r in range(1024)], [[c, c + 1] for c in range(128)]]))
    with pytest.raises(CheckpointError, match=r"pieces\[0\]\.index"):
        Checkpoint(tmp_path / "ck")


@pytest.mark.parametrize("field", ["world_size", "world_size=0", "files.rank", "files.rank=1", "pieces.rank",
                                   "pieces.rank='0'"])
def test_world_size_and_ranks_are_checked(good, tmp_path, field):
    """world_size, files.*.rank and pieces[].rank missing or out of range: inspect (and inspect --verify)
    raised a KeyError; every tool now names the field."""
    ck, step = _copy(good, tmp_path)
    rec = "rank_00000.safetensors"

    def edit(m):
        piece = m["tensors"][WTE]["pieces"][0]
        {"world_size": lambda: m.pop("world_size"), "world_size=0": lambda: m.update(world_size=0),
         "files.rank": lambda: m["files"][rec].pop("rank"), "files.rank=1": lambda: m["files"][rec].update(rank=1),
         "pieces.rank": lambda: piece.pop("rank"), "pieces.rank='0'": lambda: piece.update(rank="0")}[field]()
    _edit_manifest(step, edit)
    said = {"world_size": "'world_size'", "files.rank": f"'files.{rec}.rank'",
            "pieces.rank": f"'tensors.{WTE}.pieces[0].rank'"}[field.split("=")[0]]
    for extra in ([], ["--verify"]):
        r = subprocess.run([sys.executable, "-m", "pympar.checkpoint", "inspect", str(ck), *extra],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (extra, r.stderr[-2000:])
        assert r.stderr.startswith("pympar.checkpoint: error: ") and said in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    _refused(ck, tmp_path, said)


def test_import_metadata_that_is_not_a_string_is_one_line(good, tmp_path):
    """A header whose __metadata__ holds {"pympar.config": 5} (safetensors says str -> str; this one is not):
    json.loads(5) raised a TypeError traceback."""
    import struct
    f = _nanogpt_file(good, tmp_path)
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {"pympar.config": 5}
    _safetensors(f, header, data=raw[8 + n:])
    r = subprocess.run(_import(f, tmp_path, "--n-head", "2"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("pympar.checkpoint: error: ") and "metadata 'pympar.config'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# Runs a tool's module with the manifest check switched off: what a gap in it would let through (here a
# piece index of strings) must still reach load()'s agreement, not a traceback on the one rank that reads it.
_NO_MANIFEST_CHECK = """
import runpy, sys
import pympar.checkpoint.loading as loading
loading.check_manifest = lambda m, mf: None
mod = sys.argv[1]
sys.argv = [mod] + sys.argv[2:]
runpy.run_module(mod, run_name='__main__', alter_sys=True)
"""


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_layers") / "ck"
    save_training(root, 3, GPT(GPTConfig(**dict(CFG, n_layer=2))))
    return root


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", ["manifest check", "load() alone"])
def test_a_piece_only_one_rank_reads_fails_on_every_rank(two_layers, tmp_path, check):
    """generate on two pipeline stages, layer 1's c_attn with a piece index of strings: only rank 1 reads it.
    It printed a traceback while rank 0 waited in agree() for the comm timeout. Now the manifest check
    refuses it on both ranks; and with that check off, load() turns the TypeError into the checkpoint
    error it agrees on: every rank says the same line, exit 2, before the comm timeout."""
    from mpirun import run_mpi
    ck, step = _copy(two_layers, tmp_path)
    _edit_manifest(step, _set_index([[["a", "b"]], [[0, 16]]], "transformer.h.1.attn.c_attn.weight"))
    args = ["-m", "pympar.generate"] if check == "manifest check" else ["-c", _NO_MANIFEST_CHECK, "pympar.generate"]
    r = run_mpi(2, [*args, str(ck), "--pp", "2", "--tokens", "2", "--prompt-ids", "1,2"], timeout=150,
                cwd=tmp_path, check=False, env={"PYMPAR_COMM_TIMEOUT": 60})
    lines = [x for x in r.stdout.splitlines() if ": error" in x]
    assert r.returncode == 2, r.stdout[-3000:]
    assert len(lines) == 2 and all(x.startswith("pympar.generate: error (rank ") for x in lines), r.stdout[-3000:]
    texts = [x.split(": error", 1)[1].split(": ", 1)[1] for x in lines]     # without "(rank N)"
    assert texts[0] == texts[1] and "transformer.h.1.attn.c_attn.weight" in texts[0], lines
    assert ("pieces[0].index" if check == "manifest check" else "TypeError") in texts[0], lines
    assert "Traceback" not in r.stdout and "MPI_Abort" not in r.stdout and "timed out" not in r.stdout


def test_import_of_shapes_and_names_it_cannot_read_is_one_clear_line(good, tmp_path):
    """Without pympar metadata the config comes from the shapes: a 1-D embedding said 'not enough values
    to unpack', an expert tensor outside a block 'invalid literal for int()'; and the advice to give the
    heads with --config was not followed by import (it said the same again)."""
    from pympar.checkpoint import safetensors_format as stf
    f = _nanogpt_file(good, tmp_path, metadata={})
    tensors, _ = stf.read_all(f)
    tensors.pop("lm_head.weight", None)          # tied to wte: edited below, it would differ
    r = subprocess.run(_import(f, tmp_path, "--config", '{"n_head": 2}'), capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    for name, edit, said in (("flat", lambda t: t.__setitem__("transformer.wte.weight", t["transformer.wte.weight"][0]),
                              "expected (rows, n_embd) matrices"),
                             ("stray expert", lambda t: t.__setitem__("foo.moe.experts.0.w", np.zeros(3, np.float32)),
                              "outside transformer.h.N.moe")):
        bad = dict(tensors)
        edit(bad)
        g = tmp_path / f"{name}.safetensors"
        stf.write(g, bad, {})
        r = subprocess.run([*_import(g, tmp_path, "--n-head", "2")[:-3], str(tmp_path / name), "--n-head", "2"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr and said in r.stderr, (name, r.stderr[-2000:])
