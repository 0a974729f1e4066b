"""Read any flat range of any tensor of a checkpoint, whatever layout wrote it (resharding)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch

from mshpc.checkpoint.catalog import Catalog
from mshpc.checkpoint.h5_shard import check_datasets, from_bytes, torch_dtype
from mshpc.checkpoint.manifest import Manifest, TensorEntry
from mshpc.checkpoint.shard_read import ReadStats, ShardFiles, entry_nbytes, read_entries
from mshpc.errors import CheckpointError
from mshpc.regular_files import fd_path

# (tensor name, first flat element, element count): a range of a global tensor someone needs.
Request = tuple[str, int, int]

VERIFY_BATCH_BYTES = 2**30  # what `verify_all` holds in memory at once


class CheckpointReader:
    """A `SliceReader` over one checkpoint folder, given its whole manifest or its catalog (whose
    entries are parsed as names are asked for). Entries are read and verified in batches
    (`load`) or on first use, once each; `stats` counts what this reader took from the files."""

    def __init__(self, folder: Path, manifest: Manifest | Catalog) -> None:
        self.folder = folder
        self.catalog = manifest if isinstance(manifest, Catalog) else Catalog.whole(folder, manifest)
        self.stats = ReadStats()
        self.bytes_received = 0  # entries handed over by `put` (another rank read them)
        self._files = ShardFiles(folder)
        self._cache: dict[TensorEntry, torch.Tensor] = {}

    @property
    def manifest(self) -> Manifest:
        """The whole manifest (with an index: every entry parsed now; for tools, not restores)."""
        return self.catalog.manifest()

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.catalog.names() if n.startswith(prefix)]

    def prefetch(self, names: set[str]) -> None:
        """Parse the entries of those of `names` the checkpoint has, in one pass (catalog.py)."""
        self.catalog.load(names)

    def global_shape(self, name: str) -> tuple[int, ...]:
        return self.catalog.entries(self._require(name))[0].global_shape

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(self.catalog.entries(self._require(name))[0].dtype)

    def whole(self, name: str) -> Request:
        return (name, 0, math.prod(self.global_shape(name)))

    def _require(self, name: str) -> str:
        if name not in self.catalog:
            raise CheckpointError(f"{self.folder}: has no tensor {name!r} (does it fit this model?)")
        return name

    def entries_for(self, requests: list[Request]) -> list[TensorEntry]:
        """The entries holding any element of `requests`, each once, in file order."""
        found: set[TensorEntry] = set()
        for name, start, numel in requests:
            found.update(e for e in self.catalog.entries(self._require(name)) if e.start < start + numel and start < e.stop)
        return sorted(found, key=lambda e: (e.file, e.offset or 0, e.dataset))

    def load(self, entries: list[TensorEntry]) -> None:
        """Read and verify those of `entries` not held yet, all in one batch of parallel reads."""
        missing = [e for e in entries if e not in self._cache]
        for e, data in zip(missing, read_entries(self._files, missing, self.stats), strict=True):
            self._cache[e] = from_bytes(data, e.dtype)

    def raw(self, e: TensorEntry) -> torch.Tensor:
        """A held entry's bytes, as uint8 (what a broadcast sends)."""
        return self._cache[e].view(torch.uint8)

    def put(self, e: TensorEntry, data: torch.Tensor) -> None:
        """Hold an entry another rank read and verified: its bytes as uint8."""
        assert data.numel() == entry_nbytes(e), (e.name, data.numel())
        self._cache[e] = data.view(torch_dtype(e.dtype))
        self.bytes_received += data.numel()

    def read(self, name: str, start: int, numel: int) -> torch.Tensor:
        """Flat elements [start, start + numel) of tensor `name`, from the entries that hold them."""
        entries = self.entries_for([(name, start, numel)])
        self.load(entries)
        parts = []
        for e in sorted(entries, key=lambda e: e.start):
            lo, hi = max(start, e.start), min(start + numel, e.stop)
            parts.append(self._cache[e][lo - e.start: hi - e.start])
        if not parts:
            return torch.empty(0, dtype=self.dtype(name))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        assert out.numel() == numel, (name, start, numel)
        return out

    def read_whole(self, name: str) -> torch.Tensor:
        shape = self.global_shape(name)
        return self.read(*self.whole(name)).reshape(shape)

    def check(self, entries: list[TensorEntry]) -> int:
        """Read and verify `entries` in batches, holding none of them; return the bytes checked.
        Raises CheckpointError at the first unreadable or corrupt one."""
        return sum(len(b) for batch in _batches(entries, VERIFY_BATCH_BYTES)
                   for b in read_entries(self._files, batch, self.stats))

    def verify_all(self) -> int:
        """Read and check every entry, and that each shard's HDF5 metadata agrees with the
        manifest; return the bytes verified. Nothing stays held."""
        by_file: dict[str, list[TensorEntry]] = defaultdict(list)
        for e in self.manifest.tensors:
            by_file[e.file].append(e)
        total = 0
        for file, entries in sorted(by_file.items()):
            check_datasets(self.folder / file, entries, fd_path(self._files.fds(file)[0]))
            total += self.check(entries)
        return total

    def close(self) -> None:
        self._files.close()
        self._cache.clear()


def _batches(entries: list[TensorEntry], max_bytes: int) -> list[list[TensorEntry]]:
    """Consecutive runs of `entries` of at most `max_bytes` each (or one entry, if larger)."""
    out: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if out[-1] and size + entry_nbytes(e) > max_bytes:
            out.append([])
            size = 0
        out[-1].append(e)
        size += entry_nbytes(e)
    return out
