"""Resume: pick the newest checkpoint that verifies, falling back to older ones, with every
rank agreeing on which one (a rank that found corruption tells the others). With the manifest's
index every rank reads the index and then only the entries its dp group needs (catalog.py);
without one (an older checkpoint) rank 0 alone reads the manifest and broadcasts it. The shards
are read as group_read.py describes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from mshpc.checkpoint.catalog import Catalog, open_catalog
from mshpc.checkpoint.manifest import INDEX_FILE, parse_manifest, read_manifest_text
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


def _shared_catalog(folder: Path, group: dist.ProcessGroup) -> Catalog:
    """Collective over `group`: the catalog of `folder`. The group's first rank says whether the
    checkpoint has an index; if so each rank reads the index itself (a few MB at 12,288 ranks,
    where a broadcast of the 428 MB manifest from one rank would cost more than any parse), and
    every rank learns of any rank's failure; if not, that first rank reads the manifest and
    broadcasts it, as mshpc always did."""
    text, error, indexed = None, None, False
    if dist.get_rank(group) == 0:
        indexed = (folder / INDEX_FILE).is_file()
        try:
            text = None if indexed else read_manifest_text(folder)
        except CheckpointError as exc:
            error = str(exc)
    got = comm.broadcast_json({"text": text, "error": error, "indexed": indexed},
                              src=dist.get_global_rank(group, 0), group=group)
    if got["error"]:
        raise CheckpointError(got["error"])
    if not got["indexed"]:
        return Catalog.whole(folder, parse_manifest(folder, got["text"]), bytes_parsed=len(got["text"]))
    catalog, error = None, None
    try:
        catalog = open_catalog(folder)
    except CheckpointError as exc:
        error = str(exc)
    failed = [e for e in comm.all_gather_json(error, group=group) if e]
    if failed:
        raise CheckpointError(failed[0])
    assert catalog is not None
    return catalog


def _try(folder: Path, stage: Stage, group: dist.ProcessGroup
         ) -> tuple[Catalog | None, CheckpointReader | None, Callable[[], None] | None, str | None]:
    reader = None
    try:
        catalog = _shared_catalog(folder, group)
        reader = CheckpointReader(folder, catalog)
        return catalog, reader, stage(reader), None
    except CheckpointError as exc:
        if reader is not None:
            reader.close()
        return None, None, None, str(exc)
    except BaseException:  # a refusal (another model, another run): no older checkpoint is tried
        if reader is not None:
            reader.close()
        raise


def resume_from(folders: list[Path], stage: Stage, group: dist.ProcessGroup) -> tuple[Path, Catalog] | None:
    """Collective over `group` (a gloo group of all ranks). Returns the folder and catalog of
    the checkpoint installed, None when there is none, and raises if every one is unusable."""
    folders = [Path(p) for p in comm.all_gather_json([str(f) for f in folders], group=group)[0]]
    problems = []
    for folder in folders:
        catalog, reader, install, error = _try(folder, stage, group)
        errors = [e for e in comm.all_gather_json(error, group=group) if e]
        if errors:
            if dist.get_rank(group) == 0:  # one voice for the whole job
                    log.warning("checkpoint %s is damaged or incomplete, trying an older one: %s", folder, errors[0])
            problems.append(errors[0])
            continue
        assert catalog is not None and reader is not None and install is not None
        install()
        reader.close()
        return folder, catalog
    if problems:
        raise CheckpointError(f"no usable checkpoint among {len(folders)}; newest problem: {problems[0]}")
    return None
