"""Sharded, resharding, crash-safe checkpoints in safetensors files (no pickle).

    save(dir, step, shards, opt_shards, meta, comm, keep)   -> dir/step_<step>, dir/latest
    load(dir, wanted, comm, expect_config)                  -> ({key: array}, manifest)
    checkpoint_state(model, optimizer) / restore_into(model, optimizer, dir, comm)
    python -m pympar.checkpoint export|import|inspect ...

Tensors are stored under their GLOBAL nanoGPT names with the region of the full tensor each
piece covers, so a checkpoint written by one parallel layout loads into any other.
"""
from .errors import CheckpointCorrupt, CheckpointDiskFull, CheckpointError, CheckpointMismatch, CheckpointNotFound
from .loading import Checkpoint, load, resolve
from .saving import save

__all__ = ["save", "load", "resolve", "Checkpoint", "CheckpointError", "CheckpointCorrupt",
           "CheckpointMismatch", "CheckpointNotFound", "CheckpointDiskFull"]
from .state import checkpoint_state, restore_into, save_training  # noqa: E402

__all__ += ["checkpoint_state", "restore_into", "save_training"]
