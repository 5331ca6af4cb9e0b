"""Runs inside every rank (any size 1..8): sharded save on one group of ranks, resharded load
on another, exact equality with the full tensors.

Pairs of layouts use sub-communicators of COMM_WORLD (a save on ranks 0..N-1, a load on ranks
0..M-1), so one job of size >= max(N, M) checks N -> M; pairs needing more ranks are skipped.
CKPT_DIR (env) is a directory shared by the ranks; CKPT_PHASE=save|load with CKPT_LAYOUT and
CKPT_N run one half only (for a save and a load in two separate jobs).
"""
import os
import time

import numpy as np
import pytest

from pympar.checkpoint import CheckpointMismatch, load, save
from pympar.checkpoint.collectives import agree, allgather_json
from pympar.parallel.shard import Shard

# full tensors: shapes divisible by 1, 2, 3, 4 and 6 along every axis that gets split
SHAPES = {"transformer.wte.weight": (24, 12), "transformer.h.0.attn.c_attn.weight": (36, 12),
          "transformer.h.0.mlp.c_fc.bias": (24,), "transformer.ln_f.weight": (12,)}


def full(name, shape, salt=0.0):
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float64).reshape(shape) * 0.5 + len(name) + salt).astype(np.float32)


def _even(n, parts, r):
    w = n // parts
    return slice(r * w, (r + 1) * w)


def _uneven(n, parts, r):
    # cut points 0 < ... < n with growing piece sizes (1, 2, 3, ... scaled), all non-empty
    cuts = np.round(np.cumsum(np.arange(1, parts + 1)) / (parts * (parts + 1) / 2) * n).astype(int)
    lo = 0 if r == 0 else int(cuts[r - 1])
    return slice(lo, int(cuts[r]))


def layout_index(layout, name, shape, rank, size):
    """The Shard index ``rank`` of ``size`` holds in ``layout`` (None = replicated)."""
    if layout == "replicated" or (layout != "uneven" and len(shape) == 1 and "ln_" in name):
        return None
    if layout == "rows":                      # tensor parallel along dim 0
        return (_even(shape[0], size, rank),)
    if layout == "cols":                      # tensor parallel along the last dim
        return (slice(None),) * (len(shape) - 1) + (_even(shape[-1], size, rank),)
    if layout == "rows_dp2":                  # tp = size/2 groups, each replicated on 2 ranks
        tp = max(size // 2, 1)
        return (_even(shape[0], tp, rank % tp),)
    if layout == "qkv":                       # stacked [q; k; v] rows, each rank its heads in all 3
        if "c_attn" in name:
            c = shape[0] // 3
            sl = _even(c, size, rank)
            return (tuple(slice(i * c + sl.start, i * c + sl.stop) for i in range(3)),)
        return (_even(shape[0], size, rank),)
    if layout == "uneven":
        return (_uneven(shape[0], size, rank),)
    raise ValueError(layout)


def rank_shards(layout, rank, size, salt=0.0):
    out = {}
    for name, shape in SHAPES.items():
        ix = layout_index(layout, name, shape, rank, size)
        a = full(name, shape, salt)
        out[name] = (a, None) if ix is None else (Shard(shape, ix).take(a), Shard(shape, ix))
    return out


def rank_optim(layout, rank, size):
    return {f"{s}.{k}": (a * (2 if s == "m" else 3), sh)
            for k, (a, sh) in rank_shards(layout, rank, size).items() for s in ("m", "v")}


def wanted_for(layout, rank, size):
    want = {}
    for name, shape in SHAPES.items():
        ix = layout_index(layout, name, shape, rank, size)
        want[name] = Shard(shape, () if ix is None else ix)
        for s in ("m", "v"):
            want[f"optim.{s}.{name}"] = want[name]
    return want


def check_loaded(arrays, layout, rank, size):
    for key, sh in wanted_for(layout, rank, size).items():
        name = key.split(".", 2)[2] if key.startswith("optim.") else key
        mult = {"optim.m": 2, "optim.v": 3}.get(".".join(key.split(".")[:2]), 1)
        want = sh.take(full(name, SHAPES[name]) * mult)
        assert arrays[key].dtype == want.dtype and arrays[key].shape == want.shape, key
        np.testing.assert_array_equal(arrays[key], want, err_msg=key)


def sub(world, n):
    """A communicator of world ranks 0..n-1 (None on the others)."""
    c = world.Split(0 if world.rank < n else 1, world.rank)
    return c if world.rank < n else None


def shared_dir(world, name):
    root = os.environ.get("CKPT_DIR")
    assert root, "CKPT_DIR must name a directory all ranks can see"
    return os.path.join(root, name)


# (save ranks, save layout, load ranks, load layout)
PAIRS = [(1, "replicated", 2, "rows"), (2, "rows", 1, "replicated"), (2, "rows", 4, "cols"),
         (4, "cols", 2, "rows"), (4, "qkv", 2, "uneven"), (3, "uneven", 4, "rows_dp2"),
         (4, "rows_dp2", 3, "qkv"), (2, "cols", 2, "rows")]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}{p[1]}->{p[2]}{p[3]}")
def test_reshard_pair(mpi_world, pair):
    n_save, lay_save, n_load, lay_load = pair
    if max(n_save, n_load) > mpi_world.size:
        pytest.skip(f"needs {max(n_save, n_load)} ranks")
    d = shared_dir(mpi_world, f"pair_{n_save}{lay_save}_{n_load}{lay_load}")
    c = sub(mpi_world, n_save)
    if c is not None:
        save(d, 7, rank_shards(lay_save, c.rank, c.size), rank_optim(lay_save, c.rank, c.size),
             meta={"config": {"n_embd": 12}, "layout": lay_save}, comm=c, rank_meta={"rank": c.rank})
    mpi_world.Barrier()
    c = sub(mpi_world, n_load)
    failure = None
    if c is not None:
        arrays, manifest = load(d, wanted_for(lay_load, c.rank, c.size), comm=c,
                                expect_config={"n_embd": 12})
        try:
            assert manifest["step"] == 7 and manifest["world_size"] == n_save
            assert manifest["ranks"] == [{"rank": r} for r in range(n_save)]
            check_loaded(arrays, lay_load, c.rank, c.size)
            if lay_save == "rows_dp2":      # replicas written once: only the lowest rank of each
                assert len(manifest["files"]) == max(n_save // 2, 1)
        except AssertionError as e:
            failure = f"rank {mpi_world.rank}: {e}"
    # every rank fails together (a lone failing rank would leave the others in the next test)
    failures = [f for f in allgather_json(mpi_world, failure) if f]
    assert not failures, "\n".join(failures)


def test_error_reaches_every_rank(mpi_world):
    """A range missing on one rank's load makes every rank raise, none waits in a collective."""
    d = shared_dir(mpi_world, "err_all")
    save(d, 1, rank_shards("rows", mpi_world.rank, mpi_world.size), {}, comm=mpi_world)
    want = {"transformer.wte.weight": Shard((24, 12), ())}
    if mpi_world.rank == mpi_world.size - 1:
        want = {"transformer.wte.weight": Shard((25, 12), ())}   # another model's shape
    t0 = time.time()
    with pytest.raises(CheckpointMismatch) as e:
        load(d, want, comm=mpi_world)
    assert time.time() - t0 < 30
    assert "another model" in str(e.value) or f"rank {mpi_world.size - 1}" in str(e.value)


def test_agree_passes_when_all_ok(mpi_world):
    """No rank failed: agree returns on every rank (raising nowhere), and the ranks stay in step."""
    assert agree(mpi_world, None, "nothing") is None
    assert mpi_world.allreduce(1) == mpi_world.size


def test_phase(mpi_world):
    """One half of a save/load split over two separate mpiexec jobs (driven by env)."""
    phase = os.environ.get("CKPT_PHASE")
    if not phase:
        pytest.skip("CKPT_PHASE not set")
    d = shared_dir(mpi_world, "phase")
    layout = os.environ["CKPT_LAYOUT"]
    r, n = mpi_world.rank, mpi_world.size
    if phase == "save":
        save(d, 3, rank_shards(layout, r, n), rank_optim(layout, r, n), comm=mpi_world, keep=2)
    else:
        arrays, manifest = load(d, wanted_for(layout, r, n), comm=mpi_world)
        assert manifest["world_size"] == int(os.environ["CKPT_SAVED_BY"])
        check_loaded(arrays, layout, r, n)


def test_with_pympar_communicator(mpi_world):
    """The same save/load through pympar.comm.MPIComm (watchdog-guarded collectives)."""
    from pympar.comm import MPIComm
    c = MPIComm(mpi_world, timeout=60)
    d = shared_dir(mpi_world, "pympar_comm")
    save(d, 2, rank_shards("qkv", c.rank, c.size), rank_optim("qkv", c.rank, c.size), comm=c)
    arrays, manifest = load(d, wanted_for("cols", c.rank, c.size), comm=c)
    failure = None
    try:
        check_loaded(arrays, "cols", c.rank, c.size)
    except AssertionError as e:
        failure = f"rank {c.rank}: {e}"
    failures = [f for f in allgather_json(c, failure) if f]
    assert not failures, "\n".join(failures)
    bad = {"transformer.ln_f.weight": Shard((13,), ())} if c.rank == 0 else {}
    with pytest.raises(CheckpointMismatch):
        load(d, bad, comm=c)
