"""The asynchronous batch loader: a background thread prepares each step's batch ahead of the step.

What the thread runs is a `BatchSource`: the torch reader (`RankSource`), the DALI pipeline
(`data/dali_source.py`) or the per-node reader and its clients (`data/node_reader.py`). All of
them yield, for a given (seed, step, dp rank, dp size), the same `Batch`.
"""

from __future__ import annotations

import queue
import threading
import time
from types import TracebackType
from typing import Protocol

from mshpc.batch import Batch
from mshpc.data.window_reader import WindowReader
from mshpc.data.window_record import WindowRecord

_POLL_S = 0.05  # how often a blocked thread looks at the stop flag: bounds close() latency


class Stopped(Exception):
    """Raised by a source that was waiting when the loader was closed; ends the thread quietly."""


class BatchSource(Protocol):
    def batch(self, step: int) -> Batch:
        """The batch of `step`; steps are asked for in order, one thread at a time."""
        ...

    def close(self) -> None:
        """Release what the source holds; called once its thread has stopped."""
        ...


class RankSource:
    """The torch loader: this rank's batch, read from the memory-mapped shards on the thread."""

    def __init__(self, windows: WindowReader, dp_rank: int) -> None:
        self.windows = windows
        self.dp_rank = dp_rank

    def batch(self, step: int) -> Batch:
        return self.windows.batch(step, self.dp_rank)

    def close(self) -> None:
        pass


class BatchLoader:
    """Yields the `Batch` of steps start_step, start_step + 1, ... from `source`, prepared ahead.

    A daemon thread keeps up to `prefetch_batches` ready; its exception is raised by the next
    `next()`. `wait_s` sums the seconds the consumer spent blocked in `next()`, and `stalls`
    counts the `next()` calls that found no batch ready; `step` is the step `next()` returns.
    With `pin_memory` (for a GPU) host batches are pinned on the thread too, so that the step's
    copy to the device is asynchronous. With a `record`, each batch `next()` returns is recorded
    (data.record_windows): what the step trains on, not what the thread prepared ahead.
    """

    def __init__(self, source: BatchSource, start_step: int, prefetch_batches: int,
                 stop: threading.Event | None = None, description: str = "torch",
                 pin_memory: bool = False, record: WindowRecord | None = None) -> None:
        assert prefetch_batches >= 1, prefetch_batches
        self.source = source
        self.record = record
        self.pin_memory = pin_memory
        self.step = start_step
        self.description = description  # which loader, and why: logged once by the caller
        self.wait_s = 0.0
        self.stalls = 0
        self._queue: queue.Queue[Batch | BaseException] = queue.Queue(prefetch_batches)
        self._stop = stop or threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._produce, args=(start_step,),
                                        name="mshpc-loader", daemon=True)
        self._thread.start()

    def _produce(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                batch = self.source.batch(step)
                self._put(batch.pin() if self.pin_memory else batch)
                step += 1
        except Stopped:
            return
        except BaseException as exc:  # handed to the consumer, which raises it on next()
            self._put(exc)

    def _put(self, item: Batch | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _get(self) -> Batch | BaseException:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    raise StopIteration from None
                assert self._thread.is_alive(), "loader thread ended without reporting why"

    def ready(self) -> int:
        """Batches prepared and waiting."""
        return self._queue.qsize()

    def __next__(self) -> Batch:
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise StopIteration
        t0 = time.perf_counter()
        self.stalls += self._queue.empty()
        try:
            item = self._get()
        finally:
            self.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            self._error = item
            raise item
        if self.record is not None:
            self.record.write(self.step, item)
        self.step += 1
        return item

    def __iter__(self) -> BatchLoader:
        return self

    def close(self) -> None:
        """Stop the thread, wait (briefly) for it to end, release the source; later `next()`
        calls stop iteration. Safe to call more than once."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        if not self._closed:
            self._closed = True
            self.source.close()
            if self.record is not None:
                self.record.close()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
