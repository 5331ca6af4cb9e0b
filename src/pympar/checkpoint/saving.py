"""save(): every rank writes the pieces it owns; rank 0 writes the manifest and publishes.

A piece is (global name, Shard: the part of the full tensor it covers). Several ranks may hold the same piece
(data-parallel replicas, replicated LayerNorm weights): the lowest such rank writes it, once.
The step directory is built under a temporary name, fsynced and renamed into place; only
then does ``latest`` move (atomically), so a crash at any moment leaves the previous
checkpoint whole and ``latest`` pointing at it.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np

from ..backend import to_numpy
from . import layout_io as L
from . import safetensors_format as st
from .collectives import agree, allgather_json, rank_size
from .errors import CheckpointError, write_error
from .regions import as_shard, index_json

FORMAT = "pympar-checkpoint"
VERSION = 1


def describe(shards: dict, prefix: str = ""):
    """{file key: (array, Shard)} of {name: (array, Shard or None)}; checks the local shapes."""
    out = {}
    for name, (arr, spec) in shards.items():
        a = to_numpy(arr)
        sh = as_shard(spec, a.shape)
        if sh.local_shape != a.shape:
            raise ValueError(f"{prefix}{name}: array shape {a.shape} does not match its shard "
                             f"{index_json(sh)} of full shape {sh.full_shape} (local shape {sh.local_shape})")
        out[prefix + name] = (a, sh)
    return out


def _owners(listing):
    """{(key, index json): lowest rank holding it}; raises when ranks disagree on a tensor."""
    owners, kinds = {}, {}
    for rank, entries in enumerate(listing):
        for key, e in entries.items():
            kind = (tuple(e["full_shape"]), e["dtype"])
            if kinds.setdefault(key, (kind, rank))[0] != kind:
                k0, r0 = kinds[key]
                raise ValueError(f"{key}: rank {r0} holds full shape {k0[0]} {k0[1]}, rank {rank} holds {kind[0]} {kind[1]}")
            owners.setdefault((key, json.dumps(e["index"])), rank)
    return owners


# the steps below are separate functions so a test can stop the process between them

def _write_shard_file(path, tensors, metadata):
    return st.write(path, tensors, metadata)


def _write_manifest(tmp, manifest):
    with open(tmp / L.MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    L.fsync_dir(tmp)


def _publish(tmp, final):
    if final.exists():  # saving a step again replaces it
        L.remove_tree(final)
    os.replace(tmp, final)
    L.fsync_dir(final.parent)


def _write_latest(root, final):
    L.write_text_atomic(root / L.LATEST, final.name + "\n")


def _prune(root, keep, current):
    if not keep:
        return
    steps = [p for _, p in L.list_steps(root)]
    latest = L.read_latest(root)
    for p in steps[:-keep]:
        if p.resolve() not in (current.resolve(), latest.resolve() if latest else None):
            L.remove_tree(p)


def save(directory, step: int, shards: dict, opt_shards: dict | None = None, meta: dict | None = None,
         comm=None, keep: int | None = None, rank_meta=None) -> Path:
    """Collective: write checkpoint ``directory/step_<step>`` and point ``directory/latest`` at it.

    shards / opt_shards: {global name: (array, Shard or None)} of this rank (optimiser keys
    such as ``m.<param>`` are stored as ``optim.m.<param>``). meta: JSON-able dict (config,
    layout, data position, loss scale, optimiser step, ...), rank 0's is kept. rank_meta: a
    JSON-able value per rank (e.g. its RNG state), kept as manifest["ranks"]. keep: keep the
    newest ``keep`` checkpoints (None = all). Returns the checkpoint's path.
    """
    pending = PendingSave(directory, step, shards, opt_shards, meta, comm, keep, rank_meta)
    pending.write()
    return pending.finish()


class PendingSave:
    """One checkpoint being saved, in three parts (``save`` runs them in a row):

    __init__   collective: describe the pieces, agree who writes each, make the temporary
               directory; with ``copy=True`` this rank's pieces are copied to host memory here,
               so that training may change the arrays afterwards (an asynchronous save); into
               ``staging`` ({key: buffer}, kept by the caller between saves) when given
    write()    this rank's shard file: file I/O only, no communication (a background thread may
               run it, ``start()``)
    finish()   collective: wait for write(), agree that every rank wrote, rank 0 writes the
               manifest and publishes (rename, ``latest``). Until then the previous checkpoint
               stays the latest: a crash in between loses only this one.
    """

    def __init__(self, directory, step, shards, opt_shards=None, meta=None, comm=None, keep=None, rank_meta=None,
                 copy=False, staging=None):
        self.comm, self.step, self.meta, self.keep = comm, int(step), meta, keep
        rank, size = rank_size(comm)
        self.rank, self.size = rank, size
        self.root = root = Path(directory)
        self.final = final = root / L.step_dirname(step)
        self.tmp = tmp = root / f"{L.TMP_PREFIX}{final.name}"
        self._thread, self._written = None, threading.Event()
        self.error, self.info = None, None

        err, entries, mine = None, {}, {}
        try:
            params = describe(shards)
            clash = sorted(k for k in params if k.startswith(L.OPT_PREFIX))
            if clash:
                raise ValueError(f"parameter names {clash} start with {L.OPT_PREFIX!r}, the optimiser's prefix")
            mine = params | describe(opt_shards or {}, L.OPT_PREFIX)
            entries = {k: {"full_shape": list(sh.full_shape), "index": index_json(sh), "dtype": st.dtype_code(a.dtype)}
                       for k, (a, sh) in mine.items()}
        except (ValueError, TypeError) as e:
            err = CheckpointError(final, f"rank {rank}: {e}")
        agree(comm, err, "describing the shards to save")
        self.listing = listing = allgather_json(comm, {"entries": entries, "rank_meta": rank_meta})

        err, owners = None, {}
        try:
            owners = _owners([x["entries"] for x in listing])
            if rank == 0:
                root.mkdir(parents=True, exist_ok=True)
                L.clean_stale(root)
                tmp.mkdir()
        except (ValueError, OSError) as e:
            err = write_error(final, f"rank {rank}", e)
        agree(comm, err, "preparing the checkpoint directory")
        self.owners = owners
        self.mine = {k: (_staged(k, a, staging) if copy else a, sh) for k, (a, sh) in mine.items()
                     if owners[(k, json.dumps(entries[k]["index"]))] == rank}

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a, _ in self.mine.values())

    def write(self):
        """This rank's shard file (no communication). Errors are kept for finish()."""
        try:
            if self.mine:
                fname = L.rank_filename(self.rank)
                shards_json = {k: sh.to_json() for k, (_, sh) in self.mine.items()}
                metadata = {"pympar.format": f"{FORMAT}-shard/{VERSION}", "pympar.rank": str(self.rank),
                            "pympar.step": str(self.step),
                            "pympar.shards": json.dumps(shards_json, separators=(",", ":"))}
                digest = _write_shard_file(self.tmp / fname, {k: a for k, (a, _) in self.mine.items()}, metadata)
                self.info = {"file": fname, "sha256": digest, "bytes": (self.tmp / fname).stat().st_size,
                             "keys": sorted(self.mine)}
        except (OSError, ValueError) as e:
            self.error = write_error(self.tmp / L.rank_filename(self.rank), "writing shard file failed", e)
        self.mine = {}                     # the host copies go as soon as they are on disk
        self._written.set()

    def start(self):
        """write() on a background thread (the caller trains on; finish() waits for it)."""
        self._thread = threading.Thread(target=self.write, name=f"checkpoint step {self.step}", daemon=True)
        self._thread.start()
        return self

    @property
    def written(self) -> bool:
        """This rank's file is written (or failed): finish() would not wait here."""
        return self._written.is_set()

    def finish(self) -> Path:
        if self._thread is not None:
            self._thread.join()
        try:
            agree(self.comm, self.error, "writing shard files")
        except CheckpointError:
            if self.rank == 0:        # every rank is done with it: a partial save must not hold the space
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        written = allgather_json(self.comm, self.info)
        err = None
        if self.rank == 0:
            try:
                manifest = _manifest(self.step, self.size, self.meta, self.listing, self.owners, written)
                _write_manifest(self.tmp, manifest)
                _publish(self.tmp, self.final)
                _write_latest(self.root, self.final)
                _prune(self.root, self.keep, self.final)
            except (OSError, TypeError, ValueError) as e:   # TypeError: meta that is not JSON-able
                err = write_error(self.final, "publishing the checkpoint failed", e)
        agree(self.comm, err, "publishing the checkpoint")
        return self.final


def _staged(key, a, staging):
    """A host copy of ``a``: into ``staging[key]`` when it holds a buffer of a's shape and dtype
    (the previous save's: its pages are mapped already, so the copy runs at memory speed rather
    than at the rate the kernel hands out fresh pages), else a new one kept there for next time."""
    if staging is None:
        return np.array(a, copy=True)
    buf = staging.get(key)
    if buf is None or buf.shape != a.shape or buf.dtype != a.dtype:
        buf = staging[key] = np.empty(a.shape, a.dtype)
    np.copyto(buf, a)
    return buf


def _manifest(step, size, meta, listing, owners, written):
    tensors = {}
    for (key, index_s), rank in sorted(owners.items()):
        e = listing[rank]["entries"][key]
        t = tensors.setdefault(key, {"full_shape": e["full_shape"], "dtype": e["dtype"], "pieces": []})
        t["pieces"].append({"file": L.rank_filename(rank), "rank": rank, "index": json.loads(index_s)})
    files = {w["file"]: {"rank": r, "bytes": w["bytes"], "sha256": w["sha256"]}
             for r, w in enumerate(written) if w is not None}
    return {"format": FORMAT, "version": VERSION, "step": int(step), "world_size": size,
            "meta": meta or {}, "ranks": [x["rank_meta"] for x in listing],
            "tensors": tensors, "files": files}


def full_shards(state: dict) -> dict:
    """{name: (array, None)} of a plain {name: array} state dict (every tensor whole)."""
    return {k: (np.asarray(v), None) for k, v in state.items()}
