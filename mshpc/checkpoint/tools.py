"""`mshpc ckpt inspect` and `mshpc ckpt verify`: read a checkpoint folder (or a root of them)."""

from __future__ import annotations

import time
from pathlib import Path

from mshpc.checkpoint.h5_shard import itemsize
from mshpc.checkpoint.manifest import MANIFEST_FILE, Manifest, read_manifest
from mshpc.checkpoint.paths import committed_steps, latest_step, step_dir
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.errors import CheckpointError


def checkpoint_folders(path: Path) -> list[Path]:
    """A step folder itself, or every committed step folder under a checkpoints root."""
    if (path / MANIFEST_FILE).exists():
        return [path]
    steps = committed_steps(path)
    if not steps:
        raise CheckpointError(f"{path}: neither a checkpoint (no {MANIFEST_FILE}) nor a folder of step-* checkpoints")
    return [step_dir(path, s) for s in steps]


def _nbytes(m: Manifest) -> int:
    return sum(e.numel * itemsize(e.dtype) for e in m.tensors)


def describe(folder: Path, m: Manifest, tensors: bool) -> list[str]:
    age_s = time.time() - m.created_unix
    layout = " ".join(f"{k}={v}" for k, v in m.layout.items())
    files = sorted({e.file for e in m.tensors})
    lines = [f"{folder}: step {m.step}, {layout}, {len(m.by_name())} tensors, "
             f"{_nbytes(m) / 2**20:.1f} MiB in {len(files)} shards, {age_s / 60:.1f} min old"]
    if tensors:
        for name, entries in m.by_name().items():
            e = entries[0]
            lines.append(f"  {name}  {list(e.global_shape)} {e.dtype}  {len(entries)} slice(s)")
    return lines


def inspect(path: Path, tensors: bool = False) -> str:
    folders = checkpoint_folders(path)
    out = []
    for folder in folders:
        out += describe(folder, read_manifest(folder), tensors)
    newest = latest_step(path) if len(folders) > 1 or not (path / MANIFEST_FILE).exists() else None
    if newest is not None:
        out.append(f"latest -> step {newest}")
    return "\n".join(out)


def verify(path: Path) -> tuple[list[str], list[str]]:
    """Recompute every checksum; return (lines for the good folders, problems)."""
    good, bad = [], []
    for folder in checkpoint_folders(path):
        try:
            reader = CheckpointReader(folder, read_manifest(folder))
            try:
                nbytes = reader.verify_all()
            finally:
                reader.close()
            good.append(f"{folder}: OK ({nbytes / 2**20:.1f} MiB verified)")
        except CheckpointError as exc:
            bad.append(str(exc))
    return good, bad
