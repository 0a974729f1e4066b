"""Read any flat range of any tensor of a checkpoint, whatever layout wrote it (resharding)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mshpc.checkpoint.h5_shard import ShardReader, torch_dtype
from mshpc.checkpoint.manifest import Manifest, TensorEntry
from mshpc.errors import CheckpointError


class CheckpointReader:
    """A `SliceReader` over one checkpoint folder; each entry is read and verified once."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.folder = folder
        self.manifest = manifest
        self._entries = manifest.by_name()
        self._shards = ShardReader(folder)
        self._cache: dict[tuple[str, int], torch.Tensor] = {}

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self._entries if n.startswith(prefix))

    def global_shape(self, name: str) -> tuple[int, ...]:
        return self._entries[self._require(name)][0].global_shape

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(self._entries[self._require(name)][0].dtype)

    def _require(self, name: str) -> str:
        if name not in self._entries:
            raise CheckpointError(f"{self.folder}: has no tensor {name!r} (does it fit this model?)")
        return name

    def _entry_data(self, e: TensorEntry) -> torch.Tensor:
        key = (e.name, e.start)
        if key not in self._cache:
            self._cache[key] = self._shards.read(e)
        return self._cache[key]

    def read(self, name: str, start: int, numel: int) -> torch.Tensor:
        """Flat elements [start, start + numel) of tensor `name`, from the entries that hold them."""
        parts = []
        for e in sorted(self._entries[self._require(name)], key=lambda e: e.start):
            lo, hi = max(start, e.start), min(start + numel, e.stop)
            if lo < hi:
                parts.append(self._entry_data(e)[lo - e.start: hi - e.start])
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        assert out.numel() == numel, (name, start, numel)
        return out

    def read_whole(self, name: str) -> torch.Tensor:
        shape = self.global_shape(name)
        return self.read(name, 0, math.prod(shape)).reshape(shape)

    def verify_all(self) -> int:
        """Read and check every entry; return the bytes verified."""
        total = 0
        for entries in self._entries.values():
            for e in entries:
                t = self._shards.read(e)
                total += t.numel() * t.element_size()
        return total

    def close(self) -> None:
        self._shards.close()
        self._cache.clear()
