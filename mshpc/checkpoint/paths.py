"""Checkpoint folders: names, atomic publication, `latest`, retention.

A save writes into `step-NNNNNNN.tmp/`; rank 0 publishes it by renaming it to `step-NNNNNNN/`
after the manifest is written, then repoints `latest`. A crash at any moment therefore leaves
either the old `latest` or a complete new checkpoint, never a half one that resume would pick.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mshpc.config import CheckpointConfig

LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{7,})$")


def checkpoint_root(checkpoint: CheckpointConfig, run_dir: Path) -> Path:
    """Where a run's checkpoints live: `checkpoint.dir`, or <run dir>/checkpoints."""
    return Path(checkpoint.dir) if checkpoint.dir else run_dir / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:07d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:07d}.tmp"


def committed_steps(root: Path) -> list[int]:
    """Steps of the published checkpoint folders under `root`, oldest first."""
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(steps)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(root: Path, step: int) -> Path:
    """Rename the finished tmp folder into place and repoint `latest`, each step atomic."""
    final = step_dir(root, step)
    if final.exists():  # a re-save of the same step (e.g. after a resume): the new one wins
        shutil.rmtree(final)
    os.rename(tmp_dir(root, step), final)
    link = root / f".{LATEST}.tmp"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(final.name)
    os.replace(link, root / LATEST)
    fsync_dir(root)
    return final


def prune(root: Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed checkpoints; return the deleted steps."""
    doomed = committed_steps(root)[:-keep]
    for step in doomed:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return doomed


def remove_stale_tmp(root: Path) -> None:
    """Half-written saves of an earlier, crashed process: never resumable, only in the way."""
    if root.is_dir():
        for p in root.glob("step-*.tmp"):
            shutil.rmtree(p, ignore_errors=True)


def latest_step(root: Path) -> int | None:
    link = root / LATEST
    if not link.is_symlink():
        return None
    m = _STEP_DIR.match(os.readlink(link))
    return int(m.group(1)) if m else None
