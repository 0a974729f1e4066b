"""A ring of batch slots in anonymous shared memory (a memfd), shared by handing its descriptor on.

The memory never has a name (nothing in /dev/shm), so no exit path can leave it behind: the
kernel frees it when the last process that maps it or holds its descriptor ends, kill -9
included. Slot `step % depth` holds the batches of every served dp rank at `step`.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from mshpc.batch import Batch

MEMFD_NAME = "mshpc-batches"  # shows as /memfd:mshpc-batches in /proc/<pid>/maps


@dataclass(frozen=True)
class RingLayout:
    """The shape of a ring: `depth` slots of one local batch per served dp rank."""

    depth: int
    served: tuple[int, ...]  # dp ranks, in row order
    local_batch: int
    seq_len: int
    segments: bool  # whether segment ids (document masks) travel with the tokens

    @property
    def token_shape(self) -> tuple[int, int, int, int]:
        return (self.depth, len(self.served), self.local_batch, self.seq_len + 1)

    @property
    def segment_shape(self) -> tuple[int, int, int, int]:
        return (self.depth, len(self.served), self.local_batch, self.seq_len)

    @property
    def token_bytes(self) -> int:
        return int(np.prod(self.token_shape)) * 8

    @property
    def nbytes(self) -> int:
        return self.token_bytes + (int(np.prod(self.segment_shape)) * 4 if self.segments else 0)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RingLayout:
        fields = json.loads(data)
        return cls(**{**fields, "served": tuple(fields["served"])})


class SharedRing:
    """The slots of `layout`, mapped from the memfd `fd` (which the ring owns and closes)."""

    def __init__(self, fd: int, layout: RingLayout) -> None:
        self.fd = fd
        self.layout = layout
        self._map = mmap.mmap(fd, layout.nbytes)
        self._tokens: np.ndarray | None = np.ndarray(layout.token_shape, np.int64, buffer=self._map)
        self._segments: np.ndarray | None = None
        if layout.segments:
            self._segments = np.ndarray(layout.segment_shape, np.int32, buffer=self._map,
                                        offset=layout.token_bytes)

    @classmethod
    def create(cls, layout: RingLayout) -> SharedRing:
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, layout.nbytes)
        except OSError:
            os.close(fd)
            raise
        return cls(fd, layout)

    def write(self, step: int, row: int, batch: Batch) -> None:
        """Store `batch` as row `row` of the slot of `step`."""
        assert self._tokens is not None, "ring is closed"
        slot = step % self.layout.depth
        self._tokens[slot, row] = batch.tokens.numpy()
        if self._segments is not None:
            assert batch.segments is not None
            self._segments[slot, row] = batch.segments.numpy()

    def read(self, step: int, row: int) -> Batch:
        """A copy of row `row` of the slot of `step` (the slot is reused after the ack)."""
        assert self._tokens is not None, "ring is closed"
        slot = step % self.layout.depth
        tokens = torch.from_numpy(self._tokens[slot, row].copy())
        if self._segments is None:
            return Batch(tokens)
        return Batch(tokens, torch.from_numpy(self._segments[slot, row].copy()))

    def release_fd(self) -> None:
        """Close the descriptor once every client has its own; the mapping stays."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmap and close; the memory goes when every process has done so (or ended)."""
        self._tokens = self._segments = None  # views must go before the map can close
        self._map.close()
        self.release_fd()
