"""Names and files of a checkpoint directory, and the crash-safe ways to write them.

    ROOT/
      latest                  one line: the name of the newest complete checkpoint
      step_00000100/
        manifest.json         config, layout, step, data position, RNG, sha256 of every file
        rank_00000.safetensors  the pieces rank 0 owns, under global names
        rank_00001.safetensors
      .tmp-step_00000200/     a save in progress (removed by the next save if a crash left it)
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
OPT_PREFIX = "optim."  # file key of optimiser state: optim.<state>.<param name>
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dirname(step: int) -> str:
    return f"step_{int(step):08d}"


def rank_filename(rank: int) -> str:
    return f"rank_{int(rank):05d}.safetensors"


def fsync_dir(path):
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path, text: str):
    """Write ``path`` so that a reader sees the old or the new content, never a mix."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def list_steps(root):
    """[(step, path)] of the complete-looking checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def remove_tree(path):
    """Rename away then delete, so a crash mid-delete never leaves a half checkpoint under a real name."""
    path = Path(path)
    if not path.exists():
        return
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}.{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clean_stale(root):
    """Remove leftovers of saves or deletions a crash interrupted."""
    for p in Path(root).iterdir():
        if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def read_latest(root):
    """The checkpoint directory ``root/latest`` names, or None when there is no pointer. The pointer
    must name a ``step_N`` directory of ``root`` itself (not a path, not a link out of the folder):
    ValueError otherwise, which says so without repeating what the file holds."""
    f = Path(root) / LATEST
    if not f.is_file():
        return None
    if f.stat().st_size > 256:
        raise ValueError(f"{f}: not a checkpoint pointer ({f.stat().st_size} bytes; it holds one step_N name)")
    try:
        name = f.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: unreadable ({type(e).__name__})") from None
    target = Path(root) / name
    if not _STEP_RE.match(name) or not inside(target, root):
        raise ValueError(f"{f}: does not name a step_N checkpoint of {root} (a pointer may not lead out of its folder)")
    return target


def inside(path, folder) -> bool:
    """Whether ``path``, with every link followed, lies in ``folder`` (no '..' and no symlink out)."""
    try:
        return Path(path).resolve(strict=False).is_relative_to(Path(folder).resolve(strict=False))
    except (OSError, RuntimeError):          # a link loop
        return False


def safe_member(folder, name: str):
    """``folder / name`` for a file name a manifest lists, or None when the name is not a plain name of
    a file in ``folder`` (a path, '..', an absolute name, a link leading out)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        return None
    p = Path(folder) / name
    return p if inside(p, folder) else None
