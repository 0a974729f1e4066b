"""Resume: pick the newest checkpoint that verifies, falling back to older ones, with every
rank agreeing on which one (a rank that found corruption tells the others)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from mshpc.checkpoint.manifest import Manifest, read_manifest
from mshpc.checkpoint.paths import committed_steps, latest_step, step_dir
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.errors import CheckpointError
from mshpc.parallel import comm

log = logging.getLogger(__name__)

# stage(reader) reads and verifies what this rank needs, changing nothing, and returns the
# function that installs it (broadcasts included); it raises CheckpointError on corruption.
Stage = Callable[[CheckpointReader], Callable[[], None]]


def candidates(root: Path) -> list[Path]:
    """`latest` first, then every other committed checkpoint, newest first."""
    steps = committed_steps(root)[::-1]
    newest = latest_step(root)
    if newest in steps:
        steps.remove(newest)
        steps.insert(0, newest)
    return [step_dir(root, s) for s in steps]


def _try(folder: Path, stage: Stage) -> tuple[Manifest | None, CheckpointReader | None, Callable[[], None] | None, str | None]:
    reader = None
    try:
        manifest = read_manifest(folder)
        reader = CheckpointReader(folder, manifest)
        return manifest, reader, stage(reader), None
    except CheckpointError as exc:
        if reader is not None:
            reader.close()
        return None, None, None, str(exc)


def resume_from(folders: list[Path], stage: Stage, group: dist.ProcessGroup) -> Manifest | None:
    """Collective over `group` (a gloo group of all ranks). Returns the manifest of the
    checkpoint installed, None when there is none, and raises if every one is unusable."""
    folders = [Path(p) for p in comm.all_gather_json([str(f) for f in folders], group=group)[0]]
    problems = []
    for folder in folders:
        manifest, reader, install, error = _try(folder, stage)
        errors = [e for e in comm.all_gather_json(error, group=group) if e]
        if errors:
            if dist.get_rank(group) == 0:  # one voice for the whole job
                    log.warning("checkpoint %s is unusable, trying an older one: %s", folder, errors[0])
            problems.append(errors[0])
            continue
        assert manifest is not None and reader is not None and install is not None
        install()
        reader.close()
        return manifest
    if problems:
        raise CheckpointError(f"no usable checkpoint among {len(folders)}; newest problem: {problems[0]}")
    return None
