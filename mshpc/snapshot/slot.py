"""One in-memory snapshot buffer ("slot"): a header, the JSON extras and every tensor of a rank's
training state, laid out flat in one host buffer, so that a snapshot is one copy per tensor into
it, one checksum over it and, to reach the buddy, one message or one shared mapping.

    [header: 8 int64] [extras: EXTRAS_BYTES of JSON, zero-padded] [tensor 0] [tensor 1] ...

Header words: magic, state (EMPTY, WRITING, SEALED), step, checksum, extras length, layout digest.
A slot is trusted only when it is SEALED, its layout digest is the reader's and its checksum
matches: a snapshot cut short by a crash stays WRITING, and a bit flipped in host memory after
the seal changes the checksum.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = 0x4D534843_534E4150  # "MSHCSNAP"
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8
EXTRAS_BYTES = 64 * 1024  # the scheduler's state and the step: a few hundred bytes
ALIGN = 64  # each tensor starts on a cache line of its own
EMPTY, WRITING, SEALED = 0, 1, 2
_MAGIC, _STATE, _STEP, _CHECKSUM, _EXTRAS_LEN, _DIGEST = range(6)
_WRAP = 2**64


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the slot's start

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class SlotLayout:
    """Where each named tensor lies in a slot; the same on every snapshot of one rank (and on its
    replacement, which builds the same state), so a slot is read without any index of its own."""

    entries: tuple[Entry, ...]
    nbytes: int
    opaque: bool = False  # another rank's slot kept for it: its bytes, not its tensors, are known here

    @staticmethod
    def opaque_of(nbytes: int) -> SlotLayout:
        """The layout of a ward's slot as its buddy keeps it: a size (its owner reads it)."""
        return SlotLayout((), nbytes, opaque=True)

    @staticmethod
    def of(tensors: Mapping[str, torch.Tensor]) -> SlotLayout:
        offset, entries = HEADER_BYTES + EXTRAS_BYTES, []
        for name, t in tensors.items():
            entries.append(Entry(name, t.dtype, tuple(t.shape), offset))
            offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return SlotLayout(tuple(entries), offset)

    @property
    def digest(self) -> int:
        """A 63-bit digest of the names, dtypes and shapes: a slot of another layout is refused."""
        text = json.dumps([[e.name, str(e.dtype), e.shape] for e in self.entries])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class Slot:
    """A slot over `buffer` (uint8, `layout.nbytes` long: private, pinned or shared memory)."""

    def __init__(self, layout: SlotLayout, buffer: torch.Tensor) -> None:
        assert buffer.dtype == torch.uint8 and buffer.numel() >= layout.nbytes, (buffer.dtype, buffer.numel())
        self.layout, self.buffer = layout, buffer[: layout.nbytes]
        self._header = self.buffer[:HEADER_BYTES].view(torch.int64)

    def view(self, entry: Entry) -> torch.Tensor:
        return self.buffer[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the snapshot, as views into the slot."""
        return {e.name: self.view(e) for e in self.layout.entries}

    # ---------------------------------------------------------------- the header

    @property
    def state(self) -> int:
        return int(self._header[_STATE])

    @property
    def step(self) -> int:
        return int(self._header[_STEP])

    def begin(self, step: int, extras: dict[str, Any]) -> None:
        """Mark the slot WRITING (a crash from here on leaves it unusable), then write the extras."""
        self._header[_STATE] = WRITING
        payload = json.dumps(extras).encode()
        if len(payload) > EXTRAS_BYTES:
            raise ValueError(f"snapshot extras of {len(payload)} bytes exceed the slot's {EXTRAS_BYTES}")
        region = self.buffer[HEADER_BYTES:HEADER_BYTES + EXTRAS_BYTES]
        region.zero_()
        region[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._header[_MAGIC], self._header[_STEP] = MAGIC, step
        self._header[_EXTRAS_LEN], self._header[_DIGEST] = len(payload), self.layout.digest

    def seal(self) -> None:
        """The tensors have landed: checksum what the slot holds, then mark it SEALED."""
        self._header[_CHECKSUM] = self.checksum()
        self._header[_STATE] = SEALED

    def invalidate(self) -> None:
        self._header[_STATE] = EMPTY

    def checksum(self) -> int:
        """The sum of the slot's 64-bit words past the header, plus the step, modulo 2^64: any
        single flipped bit changes it, and it runs at memory speed (CRC32 here: 6x slower)."""
        words = self.buffer[HEADER_BYTES:].view(torch.int64)  # the layout keeps it 8-byte aligned
        total = (int(words.sum()) + self.step) % _WRAP  # torch's int64 sum wraps, as this does
        return total - _WRAP if total >= _WRAP // 2 else total

    def problem(self) -> str | None:
        """Why this slot cannot be restored from, or None when it can."""
        h = self._header
        if int(h[_MAGIC]) != MAGIC or self.state == EMPTY:
            return "empty"
        if self.state != SEALED:
            return "cut short while being written"
        if not self.layout.opaque and int(h[_DIGEST]) != self.layout.digest:
            return "of another state layout"
        if not 0 <= int(h[_EXTRAS_LEN]) <= EXTRAS_BYTES:
            return "extras length out of bounds"
        if self.checksum() != int(h[_CHECKSUM]):
            return "failed its checksum"
        return None

    def extras(self) -> dict[str, Any]:
        n = int(self._header[_EXTRAS_LEN])
        assert 0 <= n <= EXTRAS_BYTES, n  # problem() is checked first
        value = json.loads(self.buffer[HEADER_BYTES:HEADER_BYTES + n].numpy().tobytes())
        assert isinstance(value, dict)
        return value


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def private_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A slot's host buffer in this process's memory (pinned for a GPU's asynchronous copies),
    zeroed: an EMPTY header, and the pages faulted in now rather than inside a step."""
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)
