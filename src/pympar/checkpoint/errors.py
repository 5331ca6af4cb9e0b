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


class CheckpointDiskFull(CheckpointError):
    """Writing a checkpoint failed for lack of space (ENOSPC, EDQUOT) or a file-size limit (EFBIG);
    the previous checkpoint is kept."""


def write_error(path, problem: str, e: Exception) -> CheckpointError:
    """The CheckpointError for a failed write: CheckpointDiskFull when ``e`` says the disk is full."""
    import errno

    full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return (CheckpointDiskFull if full else CheckpointError)(path, f"{problem}: {e}")
