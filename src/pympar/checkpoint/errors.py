"""Checkpoint errors: each names the file (or directory) and what is wrong with it."""
from __future__ import annotations


class CheckpointError(Exception):
    """Base of every checkpoint error; ``path`` is the file or directory concerned."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class CheckpointNotFound(CheckpointError):
    """The directory, its manifest or the checkpoint ``latest`` points to does not exist."""


class CheckpointCorrupt(CheckpointError):
    """A shard file is missing, truncated, unreadable or fails its sha256 check."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint is of another model (config or tensor shapes) or lacks a wanted tensor range."""
