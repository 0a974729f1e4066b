"""Every collective mshpc issues goes through here, so the flight recorder sees all of them.

The recorder is a small per-process ring buffer of (sequence number, group, op, bytes): on a
hang it tells which collective each rank last entered.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mshpc.errors import MshpcError

RECORDER_DEPTH = 256


@dataclass(frozen=True)
class CollectiveRecord:
    seq: int
    group: str
    op: str
    nbytes: int


class FlightRecorder:
    """The last `depth` collectives this process entered, oldest first."""

    def __init__(self, depth: int = RECORDER_DEPTH) -> None:
        self._records: collections.deque[CollectiveRecord] = collections.deque(maxlen=depth)
        self._seq = 0
        self._lock = threading.Lock()

    def record(self, group: str, op: str, nbytes: int) -> None:
        with self._lock:
            self._seq += 1
            self._records.append(CollectiveRecord(self._seq, group, op, nbytes))

    def snapshot(self) -> list[CollectiveRecord]:
        with self._lock:
            return list(self._records)


# One per process by nature, like NCCL's own flight recorder: it describes this process.
RECORDER = FlightRecorder()


def _name(group: dist.ProcessGroup | None) -> str:
    return "world" if group is None else dist.get_process_group_ranks(group).__repr__()


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False,
) -> dist.Work | None:
    """Collective over `group` (all ranks of the world when None)."""
    RECORDER.record(_name(group), "all_reduce", tensor.numel() * tensor.element_size())
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    """Collective over `group`; `src` is a global rank."""
    RECORDER.record(_name(group), "broadcast", tensor.numel() * tensor.element_size())
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group`."""
    RECORDER.record(_name(group), "barrier", 0)
    dist.barrier(group=group)


def raise_if_any_failed(error: BaseException | None, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group`: if `what` failed on any rank, raise on every rank, so that no
    survivor waits forever in the next collective. A failed rank re-raises its own error."""
    on_gpu = dist.get_backend(group) == "nccl"
    flag = torch.tensor([0 if error is None else 1], device="cuda" if on_gpu else "cpu")
    all_reduce(flag, group=group)
    if error is not None:
        raise error
    if flag.item():
        raise MshpcError(f"{what} failed on {flag.item()} other rank(s); see their error")


def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Collective over `group`: every rank's JSON-able `value`, in rank order. JSON, not
    pickle, so nothing a peer sends can execute code here. The group must be a CPU (gloo) one."""
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    RECORDER.record(_name(group), "all_gather", 8 * world)
    dist.all_gather(sizes, torch.tensor([payload.numel()]), group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    RECORDER.record(_name(group), "all_gather", longest * world)
    dist.all_gather(gathered, padded, group=group)
    return [json.loads(g[: int(n.item())].numpy().tobytes()) for g, n in zip(gathered, sizes)]

