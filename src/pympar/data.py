"""Training data: token corpora and the deterministic batch stream.

Corpora (``load_corpus(spec)``; ``spec`` is the ``--data`` value, None = default):

- default (no ``--data``): the running interpreter's standard-library ``.py`` files
  (sysconfig's ``stdlib`` path; ``site-packages``/``dist-packages``, test folders and
  ``__pycache__`` excluded), sorted by relative path; byte-level tokens (vocab 256).
  The set of files differs between Python versions, so runs on different Pythons see
  different (equally real) text.
- a text file, or a directory of text files (``*.txt *.md *.py *.rst``...; every regular
  file that is not binary, sorted): byte-level tokens (vocab 256).
- a nanoGPT-style directory with ``train.bin`` and ``val.bin``: raw uint16 tokens.
- llm.c token files: a header of 256 int32 (magic 20240520, version 1 -> uint16 tokens,
  version 2 -> uint32, n_tokens) followed by the tokens. Either one ``.bin`` file (its
  ``_val`` sibling is used when the name has ``_train``), or a directory whose
  ``train.bin``/``val.bin`` (or ``*train*.bin``/``*val*.bin``) carry the header.

Validation split of text corpora: with 10 or more files, every 10th file of the sorted
list (indices 9, 19, 29, ...) is held out; with fewer files, the last 10% of the
concatenated bytes. Files are joined with one newline byte between them.

Text corpora are tokenised once and cached as uint8 ``.npy`` files under
``$PYMPAR_CACHE`` (default ``~/.cache/pympar``), keyed by a hash of the file list with
sizes and modification times. Many ranks may start at once: a file lock lets one build
the cache while the others wait, and the files appear by atomic rename. Nothing here
communicates, so a bad file fails every rank the same way before any collective.

Batches (``micro_batch``): micro-batch ``g`` of step ``i`` is ``B`` windows of
``block_size + 1`` tokens at offsets drawn from ``numpy.random.default_rng([seed, split,
i, g])`` (split 0 = train, 1 = val) -- a function of (seed, step, g) alone. The global
batch of step i is micro-batches ``g = 0 .. n_micro*dp - 1``; data-parallel rank ``r``
runs ``g = r*n_micro + j`` for its local ``j = 0 .. n_micro-1``, so a single process
running all ``n_micro*dp`` micro-batches in order computes the same step.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
_LLMC_DTYPES = {1: np.uint16, 2: np.uint32}
_TEXT_SPLIT_EVERY = 10          # every 10th file is validation
_TEXT_VAL_FRACTION = 0.1        # fewer files: last 10% of the bytes
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class DataError(ValueError):
    """A data file or directory that cannot be used: the message names it and says why."""


# the largest vocabulary grown to fit a corpus's token ids without --vocab-size (tokenizers in use stay
# far below: GPT-2 50,257; Llama 3 128,256; the largest public ones about 256k)
MAX_VOCAB = 1 << 20


@dataclass
class Corpus:
    train: np.ndarray      # (N_train,) integer tokens (uint8/uint16/uint32, maybe a memmap)
    val: np.ndarray        # (N_val,)
    vocab_size: int        # smallest vocabulary that holds every token id (256 for bytes)
    name: str              # what was loaded, for the log

    def first_token_from(self, bound: int):
        """(split, position, token) of the first token id >= bound (train first), or None."""
        for split, toks in (("train", self.train), ("val", self.val)):
            hit = np.flatnonzero(np.asarray(toks) >= bound)
            if hit.size:
                return split, int(hit[0]), int(toks[hit[0]])
        return None

    def check_vocab(self, vocab_size: int, given: bool) -> None:
        """Raise DataError naming the first token id the model cannot embed: one >= vocab_size when the
        user gave it (--vocab-size), else one >= MAX_VOCAB (a vocabulary grown to fit the data stops
        there: one stray id of 2^31 - 1 would ask for a 2^31-row embedding)."""
        bound = vocab_size if given else MAX_VOCAB
        if self.vocab_size <= bound:
            return
        split, pos, tok = self.first_token_from(bound)
        fix = (f"use --vocab-size {self.vocab_size} or more" if given else
               f"the data has token ids up to {self.vocab_size - 1}: check the file, or pass --vocab-size to "
               f"train a vocabulary that large")
        raise DataError(f"{self.name}: token {tok} at position {pos} of the {split} split is beyond the vocabulary "
                        f"({'--vocab-size ' + str(vocab_size) if given else f'{MAX_VOCAB} ids at most unless --vocab-size says more'}); {fix}")

    def check_block_size(self, block_size: int) -> None:
        """Raise DataError when a split is too short for one window of block_size+1 tokens."""
        for split, toks in (("train", self.train), ("val", self.val)):
            if len(toks) < block_size + 1:
                raise DataError(f"{self.name}: the {split} split has {len(toks)} tokens, "
                                f"fewer than block_size+1={block_size + 1}; use more data or a smaller --block-size")


# ----------------------------------------------------------------------------- loading

def load_corpus(spec: str | None = None, cache_dir: str | None = None) -> Corpus:
    """Load the corpus named by ``--data`` (None = the standard library). See module doc. A file
    that cannot be read (permissions, a directory where a file goes) is a DataError naming it."""
    try:
        return _load_corpus(spec, cache_dir)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        raise DataError(f"--data {spec}: {where}{e.strerror or e}") from None


def _load_corpus(spec, cache_dir) -> Corpus:
    if spec is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_files(root)
        if not files:
            raise DataError(f"no standard-library .py files found under {root}; pass --data")
        return _text_corpus(files, f"python{_pyver()} stdlib ({len(files)} files)", cache_dir)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"--data {spec}: no such file or directory")
    if path.is_dir():
        return _load_dir(path, cache_dir)
    if path.suffix == ".bin":
        return _load_llmc_file(path)
    _check_text(path)
    return _text_corpus([path], str(path), cache_dir)


def stdlib_files(root: Path) -> list[Path]:
    """The sorted standard-library .py files under root, without site-packages and tests."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _pyver() -> str:
    import sys
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _load_dir(path: Path, cache_dir) -> Corpus:
    bins = sorted(path.glob("*.bin"))
    if bins:
        train = path / "train.bin" if (path / "train.bin").exists() else next((b for b in bins if "train" in b.name), None)
        val = path / "val.bin" if (path / "val.bin").exists() else next((b for b in bins if "val" in b.name), None)
        if train is None or val is None:
            raise DataError(f"--data {path}: a token directory needs train.bin and val.bin "
                            f"(or *train*.bin and *val*.bin); found {[b.name for b in bins]}")
        for f in (train, val):              # never open a pipe or a device (it could block forever)
            if not f.is_file():
                raise DataError(f"{f}: not a regular file (want a token file)")
        if _has_llmc_magic(train):
            tr, va = _read_llmc(train), _read_llmc(val)
            kind = "llm.c"
        else:
            tr, va = _read_raw_u16(train), _read_raw_u16(val)
            kind = "nanoGPT"
        return _token_corpus(tr, va, f"{path} ({kind} {train.name}/{val.name})")
    files = sorted((p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")),
                   key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise DataError(f"--data {path}: the directory holds no files (want text files, or train.bin/val.bin)")
    for f in files:
        _check_text(f)
    return _text_corpus(files, f"{path} ({len(files)} text files)", cache_dir)


def _check_text(path: Path) -> None:
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: the file is empty (want text)")
    with open(path, "rb") as f:
        head = f.read(8192)
    if b"\0" in head:
        raise DataError(f"{path}: looks binary (NUL bytes in the first 8 KiB); want a text file, "
                        f"an llm.c .bin token file, or a directory with train.bin/val.bin")


def _has_llmc_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and int(np.frombuffer(head, dtype="<i4")[0]) == LLMC_MAGIC


def _read_llmc(path: Path) -> np.ndarray:
    """Tokens of an llm.c file, checked against its header (a read-only memmap)."""
    nbytes = path.stat().st_size
    hbytes = LLMC_HEADER_INTS * 4
    if nbytes < hbytes:
        raise DataError(f"{path}: {nbytes} bytes is shorter than the llm.c header ({hbytes} bytes)")
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    magic, version, n_tokens = (int(v) for v in header[:3])
    if magic != LLMC_MAGIC:
        raise DataError(f"{path}: bad llm.c magic {magic}, expected {LLMC_MAGIC} "
                        f"(raw uint16 nanoGPT files go in a directory as train.bin/val.bin)")
    if version not in _LLMC_DTYPES:
        raise DataError(f"{path}: unsupported llm.c version {version}, expected 1 (uint16) or 2 (uint32)")
    dt = np.dtype(_LLMC_DTYPES[version])
    have = (nbytes - hbytes) // dt.itemsize
    if n_tokens <= 0 or have != n_tokens or (nbytes - hbytes) % dt.itemsize:
        raise DataError(f"{path}: the header says {n_tokens} tokens but the file holds "
                        f"{(nbytes - hbytes) / dt.itemsize:g} {dt.name} tokens after the header")
    return np.memmap(path, dtype=dt, mode="r", offset=hbytes, shape=(n_tokens,))


def _read_raw_u16(path: Path) -> np.ndarray:
    nbytes = path.stat().st_size
    if nbytes == 0 or nbytes % 2:
        raise DataError(f"{path}: {nbytes} bytes is not a whole, non-empty number of uint16 tokens")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _load_llmc_file(path: Path) -> Corpus:
    train = _read_llmc(path)
    sib = path.with_name(path.name.replace("_train", "_val")) if "_train" in path.name else None
    if sib is not None and sib.exists():
        if not sib.is_file():
            raise DataError(f"{sib}: not a regular file (want the llm.c validation tokens)")
        return _token_corpus(train, _read_llmc(sib), f"{path} (llm.c, val {sib.name})")
    n_val = max(1, int(len(train) * _TEXT_VAL_FRACTION))
    return _token_corpus(train[:-n_val], train[-n_val:], f"{path} (llm.c, last 10% held out)")


def _token_corpus(train, val, name) -> Corpus:
    if len(train) == 0 or len(val) == 0:
        raise DataError(f"{name}: {len(train)} training and {len(val)} validation tokens: too few to train on")
    vocab = 1 + max(int(train.max()), int(val.max()))
    return Corpus(train, val, vocab, name)


# ----------------------------------------------------------------------------- text + cache

def cache_root(cache_dir: str | None = None) -> Path:
    """Where tokenised corpora are cached: ``cache_dir`` (the trainer passes $PYMPAR_CACHE,
    read by pympar.config) or ~/.cache/pympar."""
    return Path(cache_dir or Path.home() / ".cache" / "pympar")


def _text_corpus(files: list[Path], name: str, cache_dir) -> Corpus:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode(errors="surrogateescape"))
    key = h.hexdigest()[:16]
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = {s: root / f"bytes-{key}-{s}.npy" for s in ("train", "val")}
    if not all(p.exists() for p in paths.values()):
        # one builder at a time; the others wake up to find the files in place
        with open(root / f"bytes-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not all(p.exists() for p in paths.values()):
                train, val = _tokenise_text(files)
                for s, arr in (("train", train), ("val", val)):
                    tmp = paths[s].with_suffix(f".tmp{os.getpid()}.npy")
                    np.save(tmp, arr)
                    os.replace(tmp, paths[s])
    train = np.load(paths["train"], mmap_mode="r")
    val = np.load(paths["val"], mmap_mode="r")
    return Corpus(train, val, 256, name)


def _tokenise_text(files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """Byte tokens (uint8) of the train and validation parts (see module doc for the split)."""
    if len(files) >= _TEXT_SPLIT_EVERY:
        parts = {"train": [], "val": []}
        for i, f in enumerate(files):
            split = "val" if i % _TEXT_SPLIT_EVERY == _TEXT_SPLIT_EVERY - 1 else "train"
            parts[split].append(f.read_bytes())
        return (np.frombuffer(b"\n".join(parts["train"]), np.uint8).copy(),
                np.frombuffer(b"\n".join(parts["val"]), np.uint8).copy())
    data = np.frombuffer(b"\n".join(f.read_bytes() for f in files), np.uint8)
    n_val = max(1, int(len(data) * _TEXT_VAL_FRACTION))
    return data[:-n_val].copy(), data[-n_val:].copy()


# ----------------------------------------------------------------------------- batches

TRAIN, VAL = 0, 1


def micro_batch(tokens: np.ndarray, seed: int, step: int, g: int, batch_size: int,
                block_size: int, split: int = TRAIN) -> tuple[np.ndarray, np.ndarray]:
    """Global micro-batch g of a step: (idx, targets), each (B, T) int64, T = block_size."""
    rng = np.random.default_rng([seed, split, step, g])
    starts = rng.integers(0, len(tokens) - block_size, size=batch_size)
    win = np.stack([np.asarray(tokens[s:s + block_size + 1], dtype=np.int64) for s in starts])
    return win[:, :-1], win[:, 1:]


def local_micro_batches(tokens, seed, step, dp_rank, n_micro, batch_size, block_size, split=TRAIN):
    """The n_micro micro-batches data-parallel rank dp_rank runs at this step (g = r*n_micro + j)."""
    return [micro_batch(tokens, seed, step, dp_rank * n_micro + j, batch_size, block_size, split)
            for j in range(n_micro)]
