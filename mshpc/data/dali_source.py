"""The DALI loader: a DALI pipeline over the memory-mapped shards.

An external source reads each step's windows (batch mode: step = start_step + DALI's iteration,
so batches stay a pure function of (seed, step, dp rank, dp size)); DALI casts them to int64 on
its own threads and, on a GPU, moves them to the device itself (`.gpu()`: pinned staging, its
own stream). The result is copied device-to-device into a torch tensor: no host copy on a GPU.
On a machine without a GPU the same pipeline runs its CPU operators (device_id=None).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mshpc.batch import Batch, with_segments
from mshpc.data.window_reader import WindowReader

DALI_PREFETCH = 2  # DALI's own queue, in front of the loader thread's


def dali_missing() -> str | None:
    """None when DALI imports here, else why it does not (for the loader choice's log line)."""
    try:
        import nvidia.dali  # noqa: F401  imported only to learn whether it imports
    except ImportError as exc:
        return f"DALI is not installed ({exc}; pip install nvidia-dali-cuda130)"
    return None


def preload_dali() -> bool:
    """Import the DALI modules a loader uses, when DALI is installed (whether it is): the fork
    server (mshpc/launch/fork_server.py) pays these 0.5 CPU-s once, not each rank it forks."""
    if dali_missing() is not None:
        return False
    import nvidia.dali.fn  # noqa: F401  imported for their side effect: warm modules
    import nvidia.dali.pipeline  # noqa: F401
    import nvidia.dali.plugin.pytorch  # noqa: F401
    import nvidia.dali.types  # noqa: F401
    return True


def build_pipeline(windows: WindowReader, dp_rank: int, start_step: int, device: torch.device,
                   threads: int, errors: list[BaseException]) -> Any:
    """A built DALI pipeline whose run number i yields rank `dp_rank`'s int64 tokens of step
    start_step + i: (b, s + 1), on `device`. An exception of the reading goes into `errors`
    too: DALI re-raises it only as text inside its own RuntimeError."""
    import nvidia.dali.fn as fn
    from nvidia.dali.pipeline import Pipeline
    from nvidia.dali.types import DALIDataType

    def read(info: Any) -> np.ndarray:  # runs on the thread that calls pipe.run(): the loader's
        try:
            return windows.windows(start_step + info.iteration, dp_rank)  # (b, s + 1)
        except BaseException as exc:
            errors.append(exc)
            raise

    on_gpu = device.type == "cuda"
    device_id = (torch.cuda.current_device() if device.index is None else device.index) if on_gpu else None
    pipe = Pipeline(batch_size=windows.local_batch, num_threads=threads, device_id=device_id,
                    prefetch_queue_depth=DALI_PREFETCH)
    dtype = DALIDataType.UINT16 if windows.dtype.itemsize == 2 else DALIDataType.UINT32
    with pipe:
        rows = fn.external_source(source=read, batch=True, batch_info=True, dtype=dtype, ndim=1)
        if on_gpu:
            rows = rows.gpu()
        pipe.set_outputs(fn.cast(rows, dtype=DALIDataType.INT64))
    pipe.build()
    return pipe


class DaliSource:
    """Runs the pipeline on the loader thread and hands its output to torch; segment ids, when
    asked for, are computed by torch on the output's device."""

    def __init__(self, windows: WindowReader, dp_rank: int, start_step: int, device: torch.device,
                 threads: int) -> None:
        self.windows = windows
        self.device = device
        self._next_step = start_step
        self._errors: list[BaseException] = []
        self._pipe = build_pipeline(windows, dp_rank, start_step, device, threads, self._errors)
        # A side stream: the copy out of DALI's buffer overlaps the step on the default stream.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def batch(self, step: int) -> Batch:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        assert step == self._next_step, (step, self._next_step)  # DALI's iterations are in order
        self._next_step += 1
        try:  # given a stream, DALI makes its output ready on it, in order
            (out,) = self._pipe.run(self._stream) if self._stream is not None else self._pipe.run()
        except RuntimeError:
            if self._errors:  # the reader's own error (a DataError says what to do), not DALI's wrap
                raise self._errors[0] from None
            raise
        shape = (self.windows.local_batch, self.windows.sampler.seq_len + 1)
        if self._stream is None:
            tokens = torch.empty(shape, dtype=torch.int64)
            feed_ndarray(out.as_tensor(), tokens)
            return with_segments(tokens, self.windows.eos_id)
        with torch.cuda.stream(self._stream):
            tokens = torch.empty(shape, dtype=torch.int64, device=self.device)
            feed_ndarray(out.as_tensor(), tokens, cuda_stream=self._stream)
            batch = with_segments(tokens, self.windows.eos_id)
        # The step uses the batch on the default stream: tell the allocator, so that the memory
        # is not handed back to this stream while the step's kernels may still read it.
        for tensor in (batch.tokens, batch.segments):
            if tensor is not None:
                tensor.record_stream(torch.cuda.default_stream(self.device))
        # The batch goes to another thread, whose stream knows nothing of this one: finish here,
        # in the background, so the step never waits on it.
        self._stream.synchronize()
        return batch

    def close(self) -> None:
        self._pipe = None  # DALI frees the pipeline's threads and buffers when it is collected
