"""Resume: pick the newest checkpoint that verifies, falling back to older ones, with every
rank agreeing on which one (a rank that found corruption tells the others). Rank 0 alone reads
each manifest and broadcasts it; the shards are read as group_read.py describes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from mshpc.checkpoint.manifest import Manifest, parse_manifest, read_manifest_text
from mshpc.checkpoint.paths import committed_steps, latest_step, step_dir
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.errors import CheckpointError
from mshpc.parallel import comm

log = logging.getLogger(__name__)

# stage(reader), collective over all ranks, reads and verifies what this rank needs (sharing
# the reads within its dp group), changing nothing, and returns the function that installs it;
# it raises CheckpointError on corruption, on every rank of a dp group alike.
Stage = Callable[[CheckpointReader], Callable[[], None]]


def candidates(root: Path) -> list[Path]:
    """`latest` first, then every other committed checkpoint, newest first."""
    steps = committed_steps(root)[::-1]
    newest = latest_step(root)
    if newest in steps:
        steps.remove(newest)
        steps.insert(0, newest)
    return [step_dir(root, s) for s in steps]


def _shared_manifest(folder: Path, group: dist.ProcessGroup) -> Manifest:
    """Collective over `group`: the manifest of `folder`, read from the file system by the
    group's first rank only."""
    text, error = None, None
    if dist.get_rank(group) == 0:
        try:
            text = read_manifest_text(folder)
        except CheckpointError as exc:
            error = str(exc)
    got = comm.broadcast_json({"text": text, "error": error}, src=dist.get_global_rank(group, 0), group=group)
    if got["error"]:
        raise CheckpointError(got["error"])
    return parse_manifest(folder, got["text"])


def _try(folder: Path, stage: Stage, group: dist.ProcessGroup
         ) -> tuple[Manifest | None, CheckpointReader | None, Callable[[], None] | None, str | None]:
    reader = None
    try:
        manifest = _shared_manifest(folder, group)
        reader = CheckpointReader(folder, manifest)
        return manifest, reader, stage(reader), None
    except CheckpointError as exc:
        if reader is not None:
            reader.close()
        return None, None, None, str(exc)


def resume_from(folders: list[Path], stage: Stage, group: dist.ProcessGroup) -> tuple[Path, Manifest] | None:
    """Collective over `group` (a gloo group of all ranks). Returns the folder and manifest of
    the checkpoint installed, None when there is none, and raises if every one is unusable."""
    folders = [Path(p) for p in comm.all_gather_json([str(f) for f in folders], group=group)[0]]
    problems = []
    for folder in folders:
        manifest, reader, install, error = _try(folder, stage, group)
        errors = [e for e in comm.all_gather_json(error, group=group) if e]
        if errors:
            if dist.get_rank(group) == 0:  # one voice for the whole job
                    log.warning("checkpoint %s is unusable, trying an older one: %s", folder, errors[0])
            problems.append(errors[0])
            continue
        assert manifest is not None and reader is not None and install is not None
        install()
        reader.close()
        return folder, manifest
    if problems:
        raise CheckpointError(f"no usable checkpoint among {len(folders)}; newest problem: {problems[0]}")
    return None
