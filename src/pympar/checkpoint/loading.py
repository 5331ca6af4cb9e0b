"""load(): any rank reads any region of any tensor from a checkpoint written by any layout.

For each wanted (name, full_shape, index) the reader intersects the wanted region with the
pieces the manifest lists, copies each overlap out of its file (memory-mapped: only the
pages it needs), and checks that the overlaps cover the whole region. Every file it opens is
checked against the manifest: present, of the recorded size, of the recorded sha256.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import layout_io as L
from . import safetensors_format as st
from .collectives import agree
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointNotFound
from .regions import as_shard, index_json, intersect, shard_from_json, sub_index
from .saving import FORMAT


RUN_CHECKPOINTS = "checkpoints"   # where pympar.train --out DIR keeps its checkpoints


def resolve(directory) -> Path:
    """The checkpoint a path names. Accepted, in this order:

    - a checkpoint itself (``DIR/manifest.json``; e.g. ``OUT/checkpoints/step_400``);
    - a checkpoints folder (``DIR/latest`` names the newest complete checkpoint);
    - a run directory, the trainer's ``--out`` (``DIR/checkpoints/latest``).

    Raises CheckpointNotFound listing what was looked for."""
    p = Path(directory)
    if not p.exists():
        raise CheckpointNotFound(p, "does not exist (expected a run directory, its checkpoints/ folder or one "
                                    "step_N checkpoint)")
    if not p.is_dir():
        raise CheckpointNotFound(p, "is a file, expected a checkpoint directory")
    for root in (p, p / RUN_CHECKPOINTS):
        if (root / L.MANIFEST).is_file():
            return root
        try:
            target = L.read_latest(root)
        except ValueError as e:
            raise CheckpointCorrupt(root / L.LATEST, str(e).split(": ", 1)[-1]) from None
        if target is not None:
            if not (target / L.MANIFEST).is_file():
                raise CheckpointNotFound(root / L.LATEST, f"points to {target.name}, which has no {L.MANIFEST}")
            return target
    steps = sorted(q.name for q in (p / RUN_CHECKPOINTS if (p / RUN_CHECKPOINTS).is_dir() else p).glob("step_*"))
    hint = f" (there are {', '.join(steps[-3:])}: pass one of them)" if steps else ""
    raise CheckpointNotFound(p, f"not a checkpoint: looked for {p / L.MANIFEST} (one checkpoint), {p / L.LATEST} "
                                f"(a checkpoints folder) and {p / RUN_CHECKPOINTS / L.LATEST} (a run directory, "
                                f"the trainer's --out); found none{hint}")


MAX_MANIFEST_BYTES = 256 << 20     # a manifest lists pieces by name and index: far below this for any model


def check_manifest(m: dict, mf) -> None:
    """The manifest's fields, type- and range-checked before any is used: CheckpointCorrupt naming the
    first wrong one (its name and the expected type, never its content)."""
    def bad(field, want):
        raise CheckpointCorrupt(mf, f"field {field!r}: expected {want}")

    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not count(m.get("step")):
        bad("step", "an integer >= 0")
    for k in ("meta", "files", "tensors"):
        if k in m and not isinstance(m[k], dict):
            bad(k, "an object")
    for k in ("files", "tensors"):
        if k not in m:
            bad(k, "an object (missing)")
    world = m.get("world_size")
    if not count(world) or world < 1:
        bad("world_size", "an integer >= 1")

    def rank(v):
        return count(v) and v < world

    for name, rec in m["files"].items():
        if not isinstance(rec, dict) or not count(rec.get("bytes")) or not isinstance(rec.get("sha256"), str):
            bad(f"files.{name}", "an object with 'bytes' (an integer >= 0) and 'sha256' (a string)")
        if not rank(rec.get("rank")):
            bad(f"files.{name}.rank", f"an integer in [0, world_size={world})")
    for key, t in m["tensors"].items():
        if not isinstance(t, dict):
            bad(f"tensors.{key}", "an object")
        shape = t.get("full_shape")
        if not isinstance(shape, list) or not all(count(s) and s < 2 ** 40 for s in shape):
            bad(f"tensors.{key}.full_shape", "a list of integers in [0, 2^40)")
        if not isinstance(t.get("dtype"), str):
            bad(f"tensors.{key}.dtype", "a string")
        pieces = t.get("pieces")
        if not isinstance(pieces, list) or not all(isinstance(q, dict) and isinstance(q.get("file"), str)
                                                   and isinstance(q.get("index"), list) for q in pieces):
            bad(f"tensors.{key}.pieces", "a list of objects with 'file' (a string) and 'index' (a list)")
        for i, q in enumerate(pieces):
            if not rank(q.get("rank")):
                bad(f"tensors.{key}.pieces[{i}].rank", f"an integer in [0, world_size={world})")
            if not index_ok(q["index"], shape):
                bad(f"tensors.{key}.pieces[{i}].index", f"per dimension of full_shape ({len(shape)}) a list of "
                                                        f"[start, stop] integer blocks, 0 <= start < stop <= its "
                                                        f"length, in order, not overlapping; at most "
                                                        f"{MAX_PIECE_RECTANGLES:,} rectangles in all")


MAX_PIECE_RECTANGLES = 1 << 16   # a piece's blocks multiplied over its dimensions; pympar's layouts write
#                                  at most 3 (tp's c_attn rows in q, k and v), read() handles each in turn


def index_ok(index, shape) -> bool:
    """Whether ``index`` (a piece's index as JSON) is one list of blocks per dimension of ``shape``: each
    block [start, stop], integers, 0 <= start < stop <= the dimension's length, the blocks in order and
    not overlapping (so no more of them than the dimension's length). One empty block [s, s] is allowed
    as a dimension's only block (a rank's share of padded rows may hold none, a dimension may be 0 long).
    Checked before any piece is expanded into its rectangles (Shard.pieces(): the product of the
    dimensions' block counts, at most MAX_PIECE_RECTANGLES: below the tensor's size, one-row blocks
    of a large tensor would still be millions)."""
    if not isinstance(index, list) or len(index) != len(shape):
        return False
    rectangles = 1
    for blocks, n in zip(index, shape):
        if not isinstance(blocks, list) or not 1 <= len(blocks) <= max(n, 1):
            return False
        rectangles *= len(blocks)
        if rectangles > MAX_PIECE_RECTANGLES:
            return False
        prev = 0
        for b in blocks:
            if not (isinstance(b, list) and len(b) == 2 and all(type(v) is int for v in b)):
                return False
            start, stop = b
            if not (prev <= start < stop <= n or (len(blocks) == 1 and 0 <= start == stop <= n)):
                return False
            prev = stop
    return True


def check_fits(cfg, held_elements: int, path) -> None:
    """CheckpointMismatch when GPTConfig ``cfg``'s weight matrices alone have more elements than the
    ``held_elements`` a file holds: the model would be allocated from a claim, not from data."""
    from ..nn.config import weight_elements

    need = weight_elements(cfg)
    if need > held_elements:
        raise CheckpointMismatch(path, f"its model config (vocab_size={cfg.vocab_size}, block_size={cfg.block_size}, "
                                       f"n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, n_expert={cfg.n_expert}) needs at "
                                       f"least {need:,} weights but the file holds {held_elements:,} elements")


class Checkpoint:
    """One opened checkpoint: its manifest, and verified read access to its files."""

    def __init__(self, directory, verify: bool = True):
        self.path = resolve(directory)
        mf = self.path / L.MANIFEST
        if not L.inside(mf, self.path):       # a link to another folder's manifest: never read through
            raise CheckpointCorrupt(mf, "is a link out of the checkpoint's folder")
        try:
            size = mf.stat().st_size
            if size > MAX_MANIFEST_BYTES:
                raise CheckpointCorrupt(mf, f"{size} bytes: larger than any manifest ({MAX_MANIFEST_BYTES} at most)")
            self.manifest = json.loads(mf.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            if isinstance(e, CheckpointCorrupt):
                raise
            raise CheckpointCorrupt(mf, f"unreadable manifest ({type(e).__name__})") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            raise CheckpointCorrupt(mf, f"not a {FORMAT} manifest")
        check_manifest(self.manifest, mf)
        self._check_claims(mf)
        self.verify = verify
        self._open = {}  # file name -> (header, start)

    def _check_claims(self, mf):
        """Every file the manifest lists is a plain name in the checkpoint's folder, and, as every
        element of every tensor is stored at least once, the tensors' bytes (full shape x item size)
        do not exceed the file sizes it records (each file is checked against its record when it is
        opened; read() bounds a tensor by its files' real sizes before allocating it)."""
        for fname in self.manifest["files"]:
            if L.safe_member(self.path, fname) is None:   # "../x", "/abs", a link out: never read
                raise CheckpointCorrupt(mf, "lists a file outside the checkpoint's folder")
        claimed = sum(self._nbytes(t, t["full_shape"], mf) for t in self.tensors.values())
        recorded = sum(rec["bytes"] for rec in self.manifest["files"].values())
        if claimed > recorded:
            raise CheckpointCorrupt(mf, f"its tensors' shapes claim {claimed:,} bytes but its files hold {recorded:,}")

    @staticmethod
    def _nbytes(t, shape, mf) -> int:
        n = st.code_itemsize(t["dtype"], mf)
        for s in shape:
            n *= s
        return n

    def _real_size(self, fname) -> int:
        """The size on disk of a file the manifest lists (0 when it is missing or not a member)."""
        p = L.safe_member(self.path, fname)
        return p.stat().st_size if p is not None and p.is_file() else 0

    def files_bytes(self) -> int:
        """The real size, in bytes, of the files the manifest lists."""
        return sum(self._real_size(f) for f in self.manifest["files"])

    def model_elements(self) -> int:
        """Elements of the model's tensors (optimiser state not counted), as the manifest's shapes say."""
        n = 0
        for key, t in self.tensors.items():
            if not key.startswith(L.OPT_PREFIX):
                k = 1
                for s in t["full_shape"]:
                    k *= s
                n += k
        return n

    def model_config(self):
        """The GPTConfig the checkpoint records, checked against what it holds before any model is built
        from it: its weight matrices alone cannot have more elements than the checkpoint's model tensors
        (a 444 KB checkpoint claiming a 2^20 x 512 vocabulary would allocate 2 GB)."""
        from ..nn.config import GPTConfig

        mf = self.path / L.MANIFEST
        cfg = self.meta.get("config")
        if not cfg:
            raise CheckpointMismatch(mf, "the checkpoint records no model config")
        if not isinstance(cfg, dict):
            raise CheckpointCorrupt(mf, "field 'meta.config': expected an object")
        try:
            gcfg = GPTConfig.from_dict(cfg)
        except (TypeError, ValueError) as e:
            raise CheckpointCorrupt(mf, f"field 'meta.config': not a valid model config ({e})") from None
        check_fits(gcfg, min(self.model_elements(), self.files_bytes()), mf)   # >= 1 byte an element
        return gcfg

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def meta(self) -> dict:
        return self.manifest.get("meta", {})

    @property
    def tensors(self) -> dict:
        return self.manifest["tensors"]

    def check_config(self, expect: dict):
        """Raise CheckpointMismatch when the saved model config differs from ``expect``."""
        saved = self.meta.get("config")
        if saved is None or expect is None:
            return
        diff = {k: (saved.get(k), v) for k, v in expect.items() if k in saved and saved[k] != v}
        if diff:
            text = ", ".join(f"{k}: checkpoint {a!r}, model {b!r}" for k, (a, b) in sorted(diff.items()))
            raise CheckpointMismatch(self.path / L.MANIFEST, f"checkpoint is of another model ({text})")

    def _file(self, fname):
        if fname in self._open:
            return self._open[fname]
        path = L.safe_member(self.path, fname)
        if path is None:          # "../x", "/abs", a link out: nothing outside the checkpoint is read
            raise CheckpointCorrupt(self.path / L.MANIFEST, "lists a piece in a file outside the checkpoint's folder")
        rec = self.manifest["files"].get(fname)
        if rec is None:
            raise CheckpointCorrupt(self.path / L.MANIFEST, f"lists pieces in {fname} but has no sha256 record for it")
        if not path.is_file():
            raise CheckpointCorrupt(path, "missing shard file")
        size = path.stat().st_size
        if size != rec["bytes"]:
            what = "truncated" if size < rec["bytes"] else "wrong size"
            raise CheckpointCorrupt(path, f"{what}: {size} bytes, the manifest records {rec['bytes']}")
        if self.verify:
            got = st.sha256_file(path)
            if got != rec["sha256"]:
                raise CheckpointCorrupt(path, f"checksum mismatch: sha256 {got[:16]}..., the manifest records {rec['sha256'][:16]}...")
        header, _, start = st.read_header(path)
        self._open[fname] = (header, start)
        return header, start

    def verify_all(self) -> "Checkpoint":
        """Check the whole checkpoint without loading it: every file present, of its recorded size and
        sha256, its header sound, and every piece the manifest lists held there with its shape and
        dtype; the first problem raised as a CheckpointError naming the file. Returns self."""
        for fname in sorted(self.manifest["files"]):
            self._file(fname)
        for key, t in self.tensors.items():
            for piece in t["pieces"]:
                header, _ = self._file(piece["file"])
                local = shard_from_json(tuple(t["full_shape"]), piece["index"]).local_shape
                h = header.get(key)
                if h is None or tuple(h["shape"]) != local or h["dtype"] != t["dtype"]:
                    raise CheckpointCorrupt(self.path / piece["file"], f"does not hold {key!r} as the manifest says")
        return self

    def read(self, key, want=None):
        """The part ``want`` (Shard, (full_shape, index), or None = whole) of tensor ``key``, stored dtype."""
        t = self.tensors.get(key)
        mf = self.path / L.MANIFEST
        if t is None:
            raise CheckpointMismatch(mf, f"tensor {key!r} is not in the checkpoint")
        saved_shape = tuple(t["full_shape"])
        want = as_shard(want, saved_shape)
        if want.full_shape != saved_shape:
            raise CheckpointMismatch(mf, f"tensor {key!r} has full shape {saved_shape} in the checkpoint, "
                                         f"the model wants {want.full_shape}: checkpoint is of another model")
        files = {q["file"] for q in t["pieces"]}
        held = sum(self._real_size(f) for f in files)
        if self._nbytes(t, want.local_shape, mf) > held:   # before anything is allocated from the shape
            for f in sorted(files):
                self._file(f)                                 # a missing or truncated file: named as such
            raise CheckpointCorrupt(mf, f"tensor {key!r}: its shape claims {self._nbytes(t, want.local_shape, mf):,} "
                                        f"bytes but the files of its pieces hold {held:,}")
        out = np.empty(want.local_shape, st.code_dtype(t["dtype"], mf))
        covered = np.zeros(out.shape, bool)
        for piece in t["pieces"]:
            have = shard_from_json(saved_shape, piece["index"])
            for w_full, w_local in want.pieces():
                for h_full, h_local in have.pieces():
                    part = intersect(w_full, h_full)
                    if part is None:
                        continue
                    header, start = self._file(piece["file"])
                    path = self.path / piece["file"]
                    if key not in header or tuple(header[key]["shape"]) != have.local_shape:
                        raise CheckpointCorrupt(path, f"does not hold {key!r} with shape {have.local_shape} as the manifest says")
                    if header[key]["dtype"] != t["dtype"]:        # never cast what the manifest did not say
                        raise CheckpointCorrupt(path, f"holds {key!r} as {header[key]['dtype']}, the manifest says {t['dtype']}")
                    dst = sub_index(part, w_full, w_local)
                    out[dst] = st.read_slice(path, header, start, key, sub_index(part, h_full, h_local))
                    covered[dst] = True
        if out.size and not covered.all():
            raise CheckpointMismatch(mf, f"tensor {key!r}: the stored pieces do not cover the wanted part "
                                         f"{index_json(want)} ({int((~covered).sum())} of {out.size} elements missing)")
        return out


def load(directory, wanted: dict, comm=None, expect_config: dict | None = None, verify: bool = True):
    """Collective: ({key: array}, manifest) for this rank's ``wanted`` {key: (full_shape, index) | Shard | None}.

    Keys are global parameter names, and ``optim.<state>.<name>`` for optimiser state. Every
    rank raises (the same kind of error) when any rank fails, so none walks on into training.
    """
    err, out, manifest, ck, key = None, {}, None, None, None
    try:
        ck = Checkpoint(directory, verify=verify)
        manifest = ck.manifest
        ck.check_config(expect_config)
        for key, spec in wanted.items():
            out[key] = ck.read(key, spec)
    except CheckpointError as e:
        err = e
    except (ValueError, TypeError, LookupError, AttributeError) as e:
        # whatever the manifest check let through and a field or a piece then broke: still a damaged
        # checkpoint, agreed below -- a rank raising on alone would leave the others waiting in agree()
        where = ck.path / L.MANIFEST if ck is not None else directory
        what = "" if key is None else f"tensor {key!r}: "
        err = CheckpointCorrupt(where, f"{what}unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
    agree(comm, err, "loading the checkpoint")
    return out, manifest
