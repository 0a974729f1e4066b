"""The asynchronous batch loader: a background thread reads each step's batch ahead of the step."""

from __future__ import annotations

import queue
import threading
import time
from types import TracebackType

import numpy as np
import torch

from mshpc.data.sampler import SequenceSampler
from mshpc.data.shards import TokenDataset

_POLL_S = 0.05  # how often a blocked thread looks at the stop flag: bounds close() latency


class BatchLoader:
    """Yields int64 batches of shape (local_batch, seq_len + 1) for steps start_step, start_step + 1, ...

    Inputs are batch[:, :-1] and targets batch[:, 1:]. A daemon thread keeps up to
    `prefetch_batches` ready; its exception is raised by the next `next()`. `wait_s` sums the
    seconds the consumer spent blocked in `next()`; `step` is the step of the batch `next()` returns.
    """

    def __init__(self, dataset: TokenDataset, sampler: SequenceSampler, dp_rank: int, dp_size: int,
                 start_step: int, prefetch_batches: int) -> None:
        assert prefetch_batches >= 1 and 0 <= dp_rank < dp_size, (prefetch_batches, dp_rank, dp_size)
        assert sampler.global_batch % dp_size == 0, (sampler.global_batch, dp_size)
        self.dataset = dataset
        self.sampler = sampler
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.step = start_step
        self.wait_s = 0.0
        self._queue: queue.Queue[torch.Tensor | BaseException] = queue.Queue(prefetch_batches)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._produce, args=(start_step,),
                                        name=f"mshpc-loader-dp{dp_rank}", daemon=True)
        self._thread.start()

    def batch(self, step: int) -> torch.Tensor:
        """The batch of `step`, read now on the calling thread."""
        width = self.sampler.seq_len + 1
        starts = self.sampler.starts(step, self.dp_rank, self.dp_size)
        rows = np.stack([self.dataset.tokens(int(s), width) for s in starts])  # (b, s + 1)
        return torch.from_numpy(rows.astype(np.int64))

    def _produce(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                self._put(self.batch(step))
                step += 1
        except BaseException as exc:  # handed to the consumer, which raises it on next()
            self._put(exc)

    def _put(self, item: torch.Tensor | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _get(self) -> torch.Tensor | BaseException:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    raise StopIteration from None
                assert self._thread.is_alive(), "loader thread ended without reporting why"

    def __next__(self) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise StopIteration
        t0 = time.perf_counter()
        try:
            item = self._get()
        finally:
            self.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            self._error = item
            raise item
        self.step += 1
        return item

    def __iter__(self) -> BatchLoader:
        return self

    def close(self) -> None:
        """Stop the thread and wait (briefly) for it to end; later `next()` calls stop iteration."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def build_loader(dataset: TokenDataset, seq_len: int, global_batch: int, dp_rank: int, dp_size: int,
                 seed: int, start_step: int, prefetch_batches: int) -> BatchLoader:
    """A started loader of rank `dp_rank`'s batches from `start_step` on (each rank builds its own)."""
    sampler = SequenceSampler(dataset.n_tokens, seq_len, global_batch, seed)
    return BatchLoader(dataset, sampler, dp_rank, dp_size, start_step, prefetch_batches)
