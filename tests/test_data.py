"""pympar.data: every corpus format, its errors, the cache, and the batch stream."""
import numpy as np
import pytest

from pympar import data
from pympar.data import DataError, load_corpus, local_micro_batches, micro_batch


def write_llmc(path, tokens, version=1, magic=data.LLMC_MAGIC, n_tokens=None):
    header = np.zeros(256, np.int32)
    header[:3] = (magic, version, len(tokens) if n_tokens is None else n_tokens)
    dt = np.uint16 if version == 1 else np.uint32
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dt).tobytes())


def test_default_corpus_is_stdlib_bytes_and_cached(tmp_path):
    c = load_corpus(None, cache_dir=tmp_path)
    assert c.vocab_size == 256 and c.train.dtype == np.uint8
    assert len(c.train) > 1_000_000 and len(c.val) > 50_000
    assert b"def " in bytes(c.train[:200_000])
    cached = sorted(p.name for p in tmp_path.glob("*.npy"))
    assert len(cached) == 2
    again = load_corpus(None, cache_dir=tmp_path)
    np.testing.assert_array_equal(again.val, c.val)


def test_stdlib_list_excludes_tests_and_site_packages():
    import sysconfig
    from pathlib import Path
    root = Path(sysconfig.get_paths()["stdlib"])
    files = data.stdlib_files(root)
    rel = [f.relative_to(root).parts for f in files]
    assert not any("site-packages" in p or "test" in p or "tests" in p for p in rel)
    assert ("os.py",) in rel
    assert files == sorted(files, key=lambda p: p.relative_to(root).as_posix())


def test_text_file_holds_out_last_tenth(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(bytes(range(32, 127)) * 20)
    c = load_corpus(str(f), cache_dir=tmp_path / "cache")
    n = len(f.read_bytes())
    assert len(c.train) + len(c.val) == n and len(c.val) == n // 10
    assert bytes(c.train) + bytes(c.val) == f.read_bytes()


def test_text_dir_every_tenth_file_is_validation(tmp_path):
    d = tmp_path / "txt"
    d.mkdir()
    for i in range(20):
        (d / f"f{i:02d}.txt").write_text(f"file {i} " * 10)
    c = load_corpus(str(d), cache_dir=tmp_path / "cache")
    assert bytes(c.val) == b"\n".join([b"file 9 " * 10, b"file 19 " * 10])
    assert b"file 10 " in bytes(c.train) and b"file 9 " not in bytes(c.train)


def test_nanogpt_dir(tmp_path):
    (tmp_path / "train.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    (tmp_path / "val.bin").write_bytes(np.arange(300, dtype=np.uint16).tobytes())
    c = load_corpus(str(tmp_path))
    assert len(c.train) == 1000 and len(c.val) == 300 and c.vocab_size == 1000


def test_llmc_file_with_val_sibling_and_dir(tmp_path):
    write_llmc(tmp_path / "x_train_000.bin", np.arange(500) % 300)
    write_llmc(tmp_path / "x_val_000.bin", np.arange(100))
    c = load_corpus(str(tmp_path / "x_train_000.bin"))
    assert len(c.train) == 500 and len(c.val) == 100 and c.vocab_size == 300
    c2 = load_corpus(str(tmp_path))
    np.testing.assert_array_equal(c2.train, c.train)
    write_llmc(tmp_path / "solo.bin", np.arange(1000), version=2)
    c3 = load_corpus(str(tmp_path / "solo.bin"))
    assert len(c3.train) == 900 and len(c3.val) == 100


@pytest.mark.parametrize("case, needle", [
    ("missing", "no such file"),
    ("empty", "empty"),
    ("binary", "binary"),
    ("bad_magic", "bad llm.c magic"),
    ("bad_version", "unsupported llm.c version"),
    ("short_tokens", "header says 100 tokens"),
    ("odd_u16", "uint16"),
    ("no_val", "needs train.bin and val.bin"),
])
def test_bad_files_name_the_file(tmp_path, case, needle):
    target = tmp_path / "in"
    if case == "missing":
        target = tmp_path / "nope.txt"
    elif case == "empty":
        target.write_bytes(b"")
    elif case == "binary":
        target.write_bytes(b"abc\0def")
    elif case == "bad_magic":
        target = tmp_path / "t.bin"
        write_llmc(target, range(10), magic=1234)
    elif case == "bad_version":
        target = tmp_path / "t.bin"
        write_llmc(target, range(10), version=7)
    elif case == "short_tokens":
        target = tmp_path / "t.bin"
        write_llmc(target, range(10), n_tokens=100)
    elif case == "odd_u16":
        target.mkdir()
        (target / "train.bin").write_bytes(b"\1\2\3")
        (target / "val.bin").write_bytes(b"\1\2")
    elif case == "no_val":
        target.mkdir()
        (target / "train.bin").write_bytes(b"\1\2")
    with pytest.raises(DataError, match=needle) as e:
        load_corpus(str(target), cache_dir=tmp_path / "cache")
    assert isinstance(e.value, ValueError)
    assert str(target) in str(e.value) or target.name in str(e.value)


def test_split_too_short_for_block():
    c = data.Corpus(np.zeros(100, np.uint8), np.zeros(10, np.uint8), 256, "x")
    with pytest.raises(DataError, match="val split has 10 tokens"):
        c.check_block_size(16)


def test_micro_batch_is_function_of_seed_step_g_only():
    toks = np.arange(5000, dtype=np.uint16)
    x, y = micro_batch(toks, 7, 3, 5, 4, 16)
    assert x.shape == (4, 16) and x.dtype == np.int64
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])          # targets are shifted inputs
    np.testing.assert_array_equal(y, x + 1)                     # windows are contiguous
    x2, _ = micro_batch(toks, 7, 3, 5, 4, 16)
    np.testing.assert_array_equal(x, x2)
    assert not np.array_equal(micro_batch(toks, 7, 4, 5, 4, 16)[0], x)
    assert not np.array_equal(micro_batch(toks, 8, 3, 5, 4, 16)[0], x)


def test_dp_ranks_partition_the_single_process_batch():
    toks = np.arange(5000, dtype=np.uint16)
    single = local_micro_batches(toks, 0, 2, 0, 8, 2, 8)            # 1 rank, 8 micro-batches
    split = [mb for r in range(4) for mb in local_micro_batches(toks, 0, 2, r, 2, 2, 8)]
    for (a, _), (b, _) in zip(single, split):
        np.testing.assert_array_equal(a, b)


def test_a_token_id_beyond_any_vocabulary_is_refused_by_position(tmp_path):
    """One token id 2^31 - 1 in an llm.c file would grow the vocabulary to 2^31 rows (256 GiB of
    embedding): the trainer refuses it before allocating anything, naming the file, the split and the
    position; with --vocab-size given, a token beyond it is named the same way."""
    import resource
    import subprocess
    import sys
    toks = np.arange(5000, dtype=np.uint32) % 300
    toks[1234] = 2 ** 31 - 1
    f = tmp_path / "stray_train.bin"
    write_llmc(f, toks, version=2)
    args = [sys.executable, "-m", "pympar.train", "--data", str(f), "--preset", "tiny", "--steps", "1",
            "--dtype", "float32"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "position 1234 of the train split" in r.stderr and str(f) in r.stderr
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 2 << 20   # KiB: well below 2 GiB
    toks[1234] = 299
    write_llmc(f, toks, version=2)
    r = subprocess.run(args + ["--vocab-size", "256"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "token 256 at position 256 of the train split" in r.stderr, r.stderr[-2000:]
