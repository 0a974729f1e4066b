"""MegaScale's restore rule (sec. 4.3): within a data-parallel group, each piece of a checkpoint
is read from the file system by one rank only and broadcast to the other ranks that need it,
instead of every rank hitting the file system for the same bytes.

What that means for each kind of tensor, at the layout that wrote it: a ZeRO shard (masters,
optimizer moments) is needed by its owner only, so the owner reads it and nothing is sent; a
tensor every rank needs (`optim.step`) is read by one rank and broadcast; a rank's RNG state is
read by that rank. After a change of dp, a saved shard that several new ranks' ranges cross is
read by one of them and broadcast to the group. Of the manifest each rank parses, through its
index, only the entries its group needs (catalog.py; an older, index-less one is read by rank 0
and broadcast, restore.py); the HDF5 headers are read by nobody, since the manifest records where each
dataset's bytes lie. So no byte is read by two ranks of a dp group.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mshpc.checkpoint.manifest import TensorEntry
from mshpc.checkpoint.reader import CheckpointReader, Request
from mshpc.checkpoint.shard_read import entry_nbytes
from mshpc.errors import CheckpointError
from mshpc.parallel import comm


@dataclass(frozen=True)
class Assignment:
    entry: TensorEntry
    reader: int  # the group rank that reads it from the file system
    needers: tuple[int, ...]  # the group ranks whose requests touch it


def plan_reads(reader: CheckpointReader, needs: list[list[Request]]) -> list[Assignment]:
    """Who reads what: every entry some rank needs goes to one of the ranks needing it, largest
    entries first to the one with the fewest bytes so far, so the group's reads are spread.
    A pure function of the manifest and `needs`: every rank computes the same plan. It parses
    the entries of the names in `needs` only (catalog.py), in one pass."""
    reader.prefetch({name for requests in needs for name, _, _ in requests})
    index = EntryIndex(reader)
    needers: dict[TensorEntry, list[int]] = {}
    for rank, requests in enumerate(needs):
        for e in index.entries_for(requests):
            needers.setdefault(e, []).append(rank)
    load = [0] * len(needs)
    plan = []
    for e in sorted(needers, key=lambda e: (-entry_nbytes(e), e.file, e.dataset)):
        rank = min(needers[e], key=lambda r: (load[r], r))
        load[rank] += entry_nbytes(e)
        plan.append(Assignment(e, rank, tuple(needers[e])))
    return sorted(plan, key=lambda a: (a.entry.file, a.entry.offset or 0, a.entry.dataset))


class EntryIndex:
    """Each tensor's entries sorted by start, so the entries a range touches are found by
    bisection: after a dp change at 12,288 ranks a tensor has one entry per old dp rank and a
    group asks for one range per new dp rank, and scanning every entry for every range made
    the plan grow as dp squared (benchmarks/scale/checkpoint_scale.py)."""

    def __init__(self, reader: CheckpointReader) -> None:
        self._reader = reader
        self._sorted: dict[str, tuple[list[int], list[TensorEntry]]] = {}

    def _by_start(self, name: str) -> tuple[list[int], list[TensorEntry]]:
        if name not in self._sorted:
            entries = sorted(self._reader.entries_for([self._reader.whole(name)]), key=lambda e: e.start)
            self._sorted[name] = ([e.start for e in entries], entries)
        return self._sorted[name]

    def entries_for(self, requests: list[Request]) -> list[TensorEntry]:
        """The entries holding any element of `requests`, each once (as CheckpointReader.entries_for)."""
        found: dict[TensorEntry, None] = {}
        for name, start, numel in requests:
            starts, entries = self._by_start(name)
            i = max(0, bisect.bisect_right(starts, start) - 1)  # the entry holding `start`, or the first
            while i < len(entries) and entries[i].start < start + numel:
                if start < entries[i].stop:
                    found[entries[i]] = None
                i += 1
        return list(found)


def load_for_group(reader: CheckpointReader, requests: list[Request], group: dist.ProcessGroup,
                   error: str | None = None) -> None:
    """Collective over `group` (this rank's dp group, gloo): afterwards `reader` holds every entry
    that `requests` touch, each read by one rank of the group (`plan_reads`) and broadcast from
    it where others need it too. `error` is this rank's failure so far; any rank's failure,
    including a corrupt entry, raises the same CheckpointError on every rank."""
    shared = comm.all_gather_json({"requests": requests, "error": error}, group=group)
    _raise_first([s["error"] for s in shared])
    me = dist.get_rank(group)
    plan: list[Assignment] = []
    try:  # the plan parses entries (a bad manifest line fails here) and the reads verify them
        plan = plan_reads(reader, [[(n, s, c) for n, s, c in s["requests"]] for s in shared])
        reader.load([a.entry for a in plan if a.reader == me])
    except CheckpointError as exc:
        error = str(exc)
    _raise_first(comm.all_gather_json(error, group=group))
    _broadcast(reader, [a for a in plan if len(a.needers) > 1], group)


def _raise_first(errors: list[str | None]) -> None:
    failed = [e for e in errors if e]
    if failed:
        raise CheckpointError(failed[0])


def _broadcast(reader: CheckpointReader, shared: list[Assignment], group: dist.ProcessGroup) -> None:
    """Each entry from its reader to the group, all in flight at once; ranks that do not need
    it drop it (gloo's broadcast reaches the whole group, and a restore is rare enough)."""
    me = dist.get_rank(group)
    pending = []
    for a in shared:
        nbytes = entry_nbytes(a.entry)
        if nbytes == 0:
            continue
        data = reader.raw(a.entry) if a.reader == me else torch.empty(nbytes, dtype=torch.uint8)
        src = dist.get_global_rank(group, a.reader)
        pending.append((comm.broadcast(data, src, group=group, async_op=True), a, data))
    for work, a, data in pending:
        assert work is not None
        work.wait()
        if a.reader != me and me in a.needers:
            reader.put(a.entry, data)
