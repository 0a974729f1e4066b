"""Two-stage checkpoint save (MegaScale Sec. 4.3): stage 1 copies the state to host memory;
stage 2 writes the shards, then rank 0 commits, in a background thread that overlaps the next
steps. One save is in flight at a time.

With async saves stage 1 overlaps too: it copies beside the next step's forward and backward
(a side stream's DMA on GPU, a thread on CPU), which only read the state, and the train loop
calls `release()` before its next update writes it. The loop then waits only for whatever of
the copy the forward and backward did not hide.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mshpc.checkpoint.h5_shard import ALIGN_BYTES, check_finite, write_shard
from mshpc.checkpoint.manifest import Manifest, TensorEntry, grouped_by_name, write_manifest
from mshpc.checkpoint.paths import latest_step, prune, publish, step_dir, tmp_dir
from mshpc.errors import CheckpointError, is_disk_full
from mshpc.loss_check import StateDiverged
from mshpc.parallel import comm
from mshpc.tensor_slice import TensorSlice

log = logging.getLogger(__name__)



class NoSpaceForSave(CheckpointError):
    """A save failed on every rank alike because a file system was full or a quota used up
    (ENOSPC, EDQUOT) and nothing else went wrong: its partial files are gone, the previous
    checkpoint is still the latest. `free_bytes`: what rank 0 saw free under the root then."""

    def __init__(self, message: str, step: int, free_bytes: int | None) -> None:
        super().__init__(message)
        self.step, self.free_bytes = step, free_bytes


def _free_bytes(root: Path) -> int | None:
    try:
        return shutil.disk_usage(root).free
    except OSError:
        return None


_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)  # Linux only


@dataclass(frozen=True)
class SaveTarget:
    """Where and as what a job's checkpoints are written."""

    root: Path
    keep: int
    layout: dict[str, int]
    config_hash: str


class HostSnapshot:
    """Stage 1: host copies of the slices, into buffers kept from one save to the next (pinned
    on GPU, so the copy is a DMA): a save pays a copy, not an allocation and its page faults.
    Safe to reuse because only one save is in flight."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, piece: TensorSlice) -> TensorSlice:
        """`piece` copied into its host buffer (from a GPU: queued on the current stream)."""
        t = piece.tensor.detach()
        buf = self._buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._buffers[name] = _host_buffer(t)
        return dataclasses.replace(piece, tensor=_copy_into(buf, t))

    def take(self, slices: dict[str, TensorSlice]) -> dict[str, TensorSlice]:
        """Copy now; return when every copy has landed."""
        out = {name: self.copy(name, piece) for name, piece in slices.items()}
        if any(piece.tensor.is_cuda for piece in slices.values()):
            torch.cuda.current_stream().synchronize()
        return out

    def start(self, slices: dict[str, TensorSlice]) -> Stage1:
        """Start the copies and return at once."""
        return Stage1(self, slices)


class Stage1:
    """Stage 1 in flight. GPU sources copy on a side stream, ordered after the work that made
    them; CPU sources in a thread (memmove releases the GIL), which also allocates their buffers
    on the first save. The owner of the state calls `release` before writing it again; stage 2
    calls `wait` for the host copies."""

    def __init__(self, snapshot: HostSnapshot, slices: dict[str, TensorSlice]) -> None:
        self._names = list(slices)
        self._host: dict[str, TensorSlice] = {}
        self._error: BaseException | None = None
        gpu = {name: piece for name, piece in slices.items() if piece.tensor.is_cuda}
        self._done = self._copy_on_side_stream(snapshot, gpu) if gpu else None
        cpu = {name: piece for name, piece in slices.items() if not piece.tensor.is_cuda}
        self._thread = threading.Thread(target=self._copy, args=(snapshot, cpu), name="mshpc-ckpt-stage1",
                                        daemon=True)
        self._thread.start()

    def _copy_on_side_stream(self, snapshot: HostSnapshot, slices: dict[str, TensorSlice]) -> torch.cuda.Event:
        """DMA copies on a stream of their own, after what the current stream has queued (the
        step that made the state); returns the event that marks their end."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for name, piece in slices.items():
                self._host[name] = snapshot.copy(name, piece)
                piece.tensor.record_stream(stream)  # the allocator keeps its memory until the copy is done
        return stream.record_event()

    def _copy(self, snapshot: HostSnapshot, slices: dict[str, TensorSlice]) -> None:
        try:
            for name, piece in slices.items():
                self._host[name] = snapshot.copy(name, piece)
        except BaseException as exc:  # raised by release() and wait()
            self._error = exc

    def release(self) -> float:
        """Before the state is next written: the caller's stream waits for the GPU copies (on the
        device, not here), this thread for the CPU ones. Returns the seconds it waited."""
        start = time.perf_counter()
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        self._join()
        return time.perf_counter() - start

    def wait(self) -> dict[str, TensorSlice]:
        """The host copies, in the order the slices came, once every one has landed."""
        if self._done is not None:
            self._done.synchronize()
        self._join()
        return {name: self._host[name] for name in self._names}

    def _join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise CheckpointError(f"checkpoint stage 1 (copy to host memory) failed: {self._error}")


def _copy_into(host: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor goes through libc's memmove: on one thread it copies at the
    memory's bandwidth (7.6 GB/s here), which torch's copy_ reaches only with two threads (4.2
    GB/s on one), and a CPU job often trains with one thread per rank. Anything else: copy_."""
    if t.is_cuda or not t.is_contiguous():
        return host.copy_(t, non_blocking=t.is_cuda)
    ctypes.memmove(host.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    return host


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    """Pinned memory for a GPU tensor; page-aligned memory (an anonymous mmap) for a large CPU
    one, so the shard writer can hand it to O_DIRECT as it is. Private and populated up front:
    the kernel zeroes the pages in one pass, not one fault at a time inside the first copy, which
    makes the first save's stage 1 about 2x faster."""
    nbytes = t.numel() * t.element_size()
    if t.is_cuda or nbytes < ALIGN_BYTES:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    memory = mmap.mmap(-1, nbytes, flags=_MAP_FLAGS)
    # A forked child (a data worker) never needs these pages; without this, each of them would
    # be copy-on-write, and the next stage 1 would fault on every page it writes.
    if hasattr(mmap, "MADV_DONTFORK"):  # Linux only, like MAP_POPULATE
        memory.madvise(mmap.MADV_DONTFORK)
    return torch.frombuffer(memory, dtype=t.dtype, count=t.numel()).view(t.shape)


def _shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.h5"


class CheckpointSaver:
    """Collective over `group` (a gloo group of all ranks, used only by the background thread,
    so checkpoint traffic never interleaves with the train loop's collectives)."""

    def __init__(self, target: SaveTarget, rank: int, group: dist.ProcessGroup, async_save: bool,
                 before_commit: Callable[[int], None] = lambda step: None,
                 before_write: Callable[[int], None] = lambda step: None) -> None:
        self.target = target
        self.rank = rank
        self.group = group
        self.async_save = async_save
        self.before_commit = before_commit  # a test hook: fault injection between write and commit
        self.before_write = before_write  # a test hook: fault injection into this rank's write
        self._snapshot = HostSnapshot()
        self._stage1: Stage1 | None = None
        self._thread: threading.Thread | None = None
        self._thread_step: int | None = None  # the step the thread saves
        self._error: BaseException | None = None

    @property
    def in_flight_step(self) -> int | None:
        """The step of the save still running in the background (committed or not), if any."""
        return self._thread_step if self._thread is not None else None

    def save(self, step: int, slices: dict[str, TensorSlice], extras: dict[str, Any]) -> float:
        """Every rank calls this at the same step; returns the seconds the caller was blocked.
        Async: the slices' tensors may be read until `release()`, which the caller must call
        before writing them again."""
        start = time.perf_counter()
        self.wait()
        if self.async_save:
            self._stage1 = self._snapshot.start(slices)
            self._thread = threading.Thread(target=self._persist, args=(step, self._stage1, extras),
                                            name=f"mshpc-ckpt-{step}", daemon=True)
            self._thread.start()
            self._thread_step = step
        else:
            self._persist(step, self._snapshot.take(slices), extras)
            self._raise_pending()
        return time.perf_counter() - start

    def release(self) -> float:
        """Before the state the last save() was given is written again: wait for its stage 1
        (see Stage1.release); returns the seconds waited, 0 when none is in flight."""
        stage1, self._stage1 = self._stage1, None
        return stage1.release() if stage1 is not None else 0.0

    def wait(self) -> None:
        """Block until the save in flight, if any, has committed; raise if it failed."""
        if self._thread is not None:
            self._thread.join()  # its stage 1 ended before its writes began
            self._thread = None
        self._stage1 = None
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _persist(self, step: int, host: Stage1 | dict[str, TensorSlice], extras: dict[str, Any]) -> None:
        try:
            reports = self._write(step, host.wait() if isinstance(host, Stage1) else host)
            self.before_commit(step)
            error = self._commit(step, reports, extras) if reports is not None else None
            # Rank 0's commit outcome reaches every rank, so none goes on believing in a save
            # that is not there (nor in one that failed on another rank).
            outcome = comm.broadcast_json(error, src=dist.get_global_rank(self.group, 0), group=self.group)
            if outcome and outcome.get("no_space"):
                raise NoSpaceForSave(outcome["error"], step, outcome.get("free_bytes"))
            if outcome:
                raise (StateDiverged if outcome["diverged"] else CheckpointError)(outcome["error"])
        except BaseException as exc:  # handed to the train loop, raised by the next wait()
            self._error = exc

    def _write(self, step: int, host: dict[str, TensorSlice]) -> list[dict[str, Any]] | None:
        """Write this rank's shard; collective: rank 0 alone gets every rank's report (its
        entries, or its error) to commit from. Only rank 0 needs the entries, and gathering them
        everywhere sent each rank the whole 1.8 M-entry manifest at 12,288 ranks."""
        folder = tmp_dir(self.target.root, step)
        error, diverged, no_space = None, False, False
        entries: list[TensorEntry] = []
        try:
            self.before_write(step)
            for name, piece in host.items():  # a NaN state is never written, so never resumed from
                check_finite(piece.tensor.reshape(-1), f"rank {self.rank}: step {step}'s tensor {name!r}")
            folder.mkdir(parents=True, exist_ok=True)
            entries = write_shard(folder / _shard_name(self.rank), host)
        except CheckpointError as exc:
            error, diverged = str(exc), True
        except OSError as exc:
            error, no_space = f"rank {self.rank}: writing {folder / _shard_name(self.rank)}: {exc}", is_disk_full(exc)
        return comm.gather_json({"error": error, "diverged": diverged, "no_space": no_space,
                                 "entries": [dataclasses.asdict(e) for e in entries]},
                                dst=dist.get_global_rank(self.group, 0), group=self.group)

    def _commit(self, step: int, reports: list[dict[str, Any]], extras: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0: manifest last, then publish and prune; returns the error (its message, whether
        it is a diverged state, whether a full disk alone caused it, the bytes then free) or None.
        A failed save leaves no files of its own behind."""
        t = self.target
        failed = [r for r in reports if r["error"]]
        if failed:
            shutil.rmtree(tmp_dir(t.root, step), ignore_errors=True)
            return {"error": f"checkpoint of step {step} failed: {failed[0]['error']}",
                    "diverged": failed[0]["diverged"], "no_space": all(r["no_space"] for r in failed),
                    "free_bytes": _free_bytes(t.root)}
        entries = [TensorEntry(**{**e, "global_shape": tuple(e["global_shape"])})
                   for r in reports for e in r["entries"]]
        # Each tensor's entries together (in rank order), so the manifest's index gives each
        # name one byte range, which a restoring rank reads and parses alone (catalog.py).
        manifest = Manifest(step=step, config_hash=t.config_hash, layout=t.layout,
                            tensors=grouped_by_name(entries), extras=extras, created_unix=time.time())
        try:
            write_manifest(tmp_dir(t.root, step), manifest)
            final = publish(t.root, step)
        except OSError as exc:
            _unpublish(t.root, step)
            return {"error": f"committing checkpoint of step {step} in {t.root}: {exc}", "diverged": False,
                    "no_space": is_disk_full(exc), "free_bytes": _free_bytes(t.root)}
        deleted = prune(t.root, t.keep)
        log.info("checkpoint %s committed%s", final, f"; pruned steps {deleted}" if deleted else "")
        return None


def _unpublish(root: Path, step: int) -> None:
    """After a failed commit: its files go, and so does its folder if the rename happened but
    `latest` was not repointed to it, so the checkpoint before stays the newest."""
    shutil.rmtree(tmp_dir(root, step), ignore_errors=True)
    if latest_step(root) != step:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
