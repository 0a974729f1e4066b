"""The `model/` copy of a checkpoint: the whole weights for inference and export, beside the fp32
masters that training resumes from (state.py). Resume never needs the copy, so without a check
a corrupt one would be kept silently. It is derived from the masters (the weights are the
masters cast to the weights' dtype, gathered after every step), so a bad one is rebuilt from
them: recomputed, written over the bad bytes, its checksum put back in the manifest.

`check_model_copy` is the check before export (`mshpc export`); `read_model_copy` reads the
copy whole at tp=1 for export and `mshpc generate`; `repair_on_resume` is the collective that a
resume runs on the checkpoint it took.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mshpc.checkpoint.catalog import Catalog
from mshpc.checkpoint.h5_shard import rewrite_dataset, to_numpy, torch_dtype
from mshpc.checkpoint.manifest import Manifest, TensorEntry, read_manifest, replace_manifest
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.relayout import Relayout
from mshpc.checkpoint.shard_read import entry_nbytes
from mshpc.checkpoint.state import spread
from mshpc.errors import CheckpointError
from mshpc.parallel import comm

MODEL = "model/"


@dataclass(frozen=True)
class Repair:
    """One bad model/ entry and what was done about it."""

    tensor: str
    file: str
    dataset: str
    problem: str  # what the check found
    crc32: int | None  # the rebuilt bytes' checksum; None when the rebuild failed
    error: str | None = None  # why the rebuild failed


def model_entries(m: Manifest) -> list[TensorEntry]:
    return [e for e in m.tensors if e.name.startswith(MODEL)]


def find_bad(reader: CheckpointReader, entries: list[TensorEntry]) -> list[tuple[TensorEntry, str]]:
    """Those of `entries` that are unreadable or fail their checksum, each with the problem. One
    batched pass; entry by entry only once it has failed (a rare path)."""
    try:
        reader.check(entries)
        return []
    except CheckpointError:
        pass
    bad = []
    for e in entries:
        try:
            reader.check([e])
        except CheckpointError as exc:
            bad.append((e, str(exc)))
    return bad


def check_model_copy(folder: Path) -> None:
    """Raise a CheckpointError naming the first model/ tensor and file of the checkpoint `folder`
    that is unreadable or corrupt (and how many are). What an export must call first."""
    reader = CheckpointReader(folder, read_manifest(folder))
    try:
        bad = find_bad(reader, model_entries(reader.manifest))
    finally:
        reader.close()
    if bad:
        more = f" (and {len(bad) - 1} more model/ tensor(s))" if len(bad) > 1 else ""
        raise CheckpointError(bad[0][1] + more)


def read_model_copy(folder: Path) -> dict[str, torch.Tensor]:
    """Every whole weight of the checkpoint `folder`'s `model/` copy, by parameter name: written
    at tp > 1, each weight's tp parts are joined by the manifest's rules (relayout.py); at pp > 1
    every stage's layers are there under their full-model names, the tied embedding's second
    copy (`lm_head.weight`) included."""
    reader = CheckpointReader(folder, read_manifest(folder))
    try:
        relayout = Relayout.build(reader, new_tp=1, new_rank=0, current={}, tied=frozenset())
        read = relayout.reader(reader)
        out = {}
        for name in sorted({n.removeprefix(MODEL).partition("@tp")[0] for n in reader.names(MODEL)}):
            shape = relayout.shape(reader, MODEL + name)
            out[name] = read(MODEL + name, 0, math.prod(shape)).reshape(shape).clone()
        return out
    finally:
        reader.close()


def rebuild(reader: CheckpointReader, e: TensorEntry, problem: str) -> Repair:
    """Recompute model/ entry `e`, found bad with `problem`, from its verified masters and write
    it over the stored bytes."""
    try:
        master = reader.read(f"master/{e.name.removeprefix(MODEL)}", e.start, e.numel)
        data = to_numpy(master.to(torch_dtype(e.dtype)).contiguous())  # as the all-gather casts them
        rewrite_dataset(reader.folder, e, data)
    except (CheckpointError, OSError) as exc:
        return Repair(e.name, e.file, e.dataset, problem, None, str(exc))
    return Repair(e.name, e.file, e.dataset, problem, zlib.crc32(data.data.cast("B")))


def repair(reader: CheckpointReader, entries: list[TensorEntry]) -> list[Repair]:
    """Check `entries` (model/ ones) and rebuild each bad one; what was found and done. The
    manifest's checksums are `fix_checksums`'s to update."""
    return [rebuild(reader, e, problem) for e, problem in find_bad(reader, entries)]


def _share(entries: list[TensorEntry], rank: int, world: int) -> list[TensorEntry]:
    """This rank's part of the check: the entries spread over the ranks by bytes."""
    owners = spread([entry_nbytes(e) for e in entries], world)
    return [e for e, owner in zip(entries, owners, strict=True) if owner == rank]


def fix_checksums(folder: Path, m: Manifest, repairs: list[Repair]) -> str | None:
    """Put the rebuilt entries' checksums into the manifest where they differ (the bytes were
    sound but their recorded checksum was not); returns why that failed, or None."""
    new = {(r.file, r.dataset): r.crc32 for r in repairs if r.crc32 is not None}
    tensors = tuple(dataclasses.replace(e, crc32=new.get((e.file, e.dataset), e.crc32)) for e in m.tensors)
    if tensors == m.tensors:
        return None
    try:
        replace_manifest(folder, dataclasses.replace(m, tensors=tensors))
    except OSError as exc:
        return f"rewriting {folder}'s manifest: {exc}"
    return None


def repair_on_resume(folder: Path, catalog: Catalog, group: dist.ProcessGroup) -> tuple[list[Repair], str | None]:
    """Collective over `group` (a gloo group of all ranks): each rank checks its share of the
    model/ entries of the checkpoint `folder` and rebuilds the bad ones from the masters; the
    group's first rank then fixes the manifest's checksums (reading it whole: a rare path).
    Returns every rank's repairs, and on the first rank why fixing the manifest failed (None if
    it did not)."""
    reader = CheckpointReader(folder, catalog)
    error = None
    try:
        names = reader.names(MODEL)
        reader.prefetch(set(names))  # the model/ entries alone, whatever the world's size
        entries = [e for n in names for e in catalog.entries(n)]
        repairs = repair(reader, _share(entries, dist.get_rank(group), dist.get_world_size(group)))
    except CheckpointError as exc:  # a model/ entry's manifest line is bad: no copy to check
        repairs, error = [], str(exc)
    finally:
        reader.close()
    everyone = [Repair(**r) for rank in comm.all_gather_json([dataclasses.asdict(r) for r in repairs], group=group)
                for r in rank]
    if dist.get_rank(group) != 0:
        return everyone, None
    if everyone:
        try:
            error = fix_checksums(folder, read_manifest(folder), everyone) or error
        except CheckpointError as exc:
            error = str(exc)
    return everyone, error
