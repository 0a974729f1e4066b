"""This rank's snapshots in host memory: two slots taken in turn (double buffering: while one is
being written the other holds the previous snapshot whole), each copied from the live state,
sealed with its checksum and handed to the buddy (mshpc/snapshot/exchange.py).

A snapshot is taken after a step's update and overlaps the next step, as a checkpoint's stage 1
does (mshpc/checkpoint/saver.py): GPU tensors are copied by DMA on a side stream into pinned
memory, CPU ones in a thread; the next update waits only for the copies (`release`, registered
with the engine's `before_next_update`), and the seal and the hand-over run on in the thread
until the next snapshot is taken. One snapshot is in flight at a time.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mshpc.snapshot.slot import Slot, SlotLayout


class Exchange(Protocol):
    """How the buddy gets its copy of each sealed slot, and the wards' slots this rank keeps."""

    def ship(self, index: int, slot: Slot) -> None: ...  # in the snapshot's thread, after the seal
    def held(self) -> dict[int, list[Slot]]: ...  # ward rank -> its slots kept here
    def close(self) -> None: ...


class SnapshotStore:
    """Collective over the exchange's group when it ships (every rank takes the same steps)."""

    def __init__(self, layout: SlotLayout, own: list[Slot], exchange: Exchange) -> None:
        assert len(own) == 2
        self.layout, self.own, self.exchange = layout, own, exchange
        self._next = 0
        self._flight: _Flight | None = None

    def take(self, step: int, live: dict[str, torch.Tensor], extras: dict[str, Any],
             before_next_update: Callable[[Callable[[], None]], None]) -> None:
        """Snapshot `live` (the state after `step` updates) into the older slot; returns once the
        copies are started. The state must not change before the registered release has run."""
        self.settle()
        index, self._next = self._next, 1 - self._next
        slot = self.own[index]
        slot.begin(step, extras)
        self._flight = _Flight(slot, index, live, self.exchange)
        before_next_update(self._flight.release)

    def settle(self) -> None:
        """Wait for the snapshot in flight to be sealed and handed over; raises its error."""
        flight, self._flight = self._flight, None
        if flight is not None:
            flight.wait()

    def sealed(self) -> list[Slot]:
        """This rank's own slots that a restore may use (their checksums are checked there)."""
        return [s for s in self.own if s.problem() != "empty"]

    def close(self) -> None:
        """After an error too: the copies end (they read the live state, which must outlive
        them), the error of the hand-over, if any, is dropped: the caller is failing already."""
        flight, self._flight = self._flight, None
        if flight is not None:
            flight.join()
        self.exchange.close()


class _Flight:
    """One snapshot being taken: copies, then the seal and the hand-over, in a thread."""

    def __init__(self, slot: Slot, index: int, live: dict[str, torch.Tensor], exchange: Exchange) -> None:
        self.slot, self.index, self.exchange = slot, index, exchange
        self.copied = threading.Event()
        self.error: BaseException | None = None
        targets = slot.tensors()
        gpu = {n: t for n, t in live.items() if t.is_cuda}
        self._done = _copy_on_side_stream(gpu, targets) if gpu else None
        cpu = [(t, targets[n]) for n, t in live.items() if not t.is_cuda]
        self._thread = threading.Thread(target=self._run, args=(cpu,), name="mshpc-snapshot", daemon=True)
        self._thread.start()

    def _run(self, cpu: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            for source, target in cpu:
                _copy_into(target, source)
            self.copied.set()
            if self._done is not None:
                self._done.synchronize()
            self.slot.seal()
            self.exchange.ship(self.index, self.slot)
        except BaseException as exc:  # raised by wait()
            self.error = exc
        finally:
            self.copied.set()

    def release(self) -> None:
        """Before the state is next written: the caller's stream waits for the GPU copies (on the
        device), this thread for the CPU ones."""
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        self.copied.wait()

    def wait(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error

    def join(self) -> None:
        self._thread.join()


def _copy_on_side_stream(live: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.cuda.Event:
    """DMA copies into the pinned slot on a stream of their own, after what the current stream
    has queued (the update that made the state); returns the event that marks their end."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for name, source in live.items():
            targets[name].copy_(source, non_blocking=True)
            source.record_stream(stream)  # the allocator keeps its memory until the copy is done
    return stream.record_event()


def _copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """libc's memmove for a contiguous CPU tensor: on one thread it copies at the memory's
    bandwidth, which torch's copy_ reaches only with two (mshpc/checkpoint/saver.py measured it)."""
    if not source.is_contiguous():
        target.copy_(source)
        return
    ctypes.memmove(target.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
