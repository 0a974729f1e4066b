"""Every collective mshpc issues goes through here, so the flight recorder and the phase timers
see all of them: each wrapper issues its op through `collective`, the one door.

The recorder is a small per-process ring buffer of (sequence number, group, op, bytes): on a
hang it tells which collective each rank last entered. The timers time each op as the phase
"comm.<op>" (mshpc/diagnose/timers.py): the call, and for an async op the wait on its handle.

The bulk collectives (reduce-scatter, all-gather) move their bytes through a `Transport`: torch's
own collectives (NCCL on GPU ranks) unless start-up installed another (CPU ranks: gloo's point-to-
point transport, mshpc/cpu_ranks/gloo_p2p.py).
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from mshpc.diagnose.timers import COMM_PREFIX, TIMERS
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
        self._counts: dict[str, int] = {}

    def record(self, group: str, op: str, nbytes: int) -> None:
        with self._lock:
            self._seq += 1
            self._records.append(CollectiveRecord(self._seq, group, op, nbytes))
            self._counts[group] = self._counts.get(group, 0) + 1

    def counts(self) -> dict[str, int]:
        """Collectives entered per group: equal on every member of a group unless one is missing
        from the group's latest collective (what a hang report compares across ranks)."""
        with self._lock:
            return dict(self._counts)

    def snapshot(self) -> list[CollectiveRecord]:
        with self._lock:
            return list(self._records)


# One per process by nature, like NCCL's own flight recorder: it describes this process.
RECORDER = FlightRecorder()


def _name(group: dist.ProcessGroup | None) -> str:
    return "world" if group is None else dist.get_process_group_ranks(group).__repr__()


class Timed:
    """An async op's handle whose wait() is timed as the op's phase: the time the caller is
    blocked on it (on GPU, the time its stream waits for the collective's)."""

    __slots__ = ("_work", "_phase")

    def __init__(self, work: Any, phase: str) -> None:
        self._work, self._phase = work, phase

    def wait(self) -> bool:
        with TIMERS.phase(self._phase):
            return self._work.wait()

    def __getattr__(self, name: str) -> Any:  # is_completed(), get_future(), ... of the op's own
        return getattr(self._work, name)


_Handle = TypeVar("_Handle")


class Pending(Protocol):
    """What an async op returns (torch's Work, a Timed one, a transport's own): wait() blocks
    until the op is done."""

    def wait(self) -> bool: ...


def collective(
    group: dist.ProcessGroup | None, op: str, nbytes: int, issue: Callable[[], _Handle], peer: str = ""
) -> _Handle | Timed:
    """The one door of every op: record it for the flight recorder (point-to-point ops with
    their `peer`, e.g. "send->3"), time it as phase "comm.<op>", and return its handle (None
    for a blocking op) with a timed wait(). Also the door of an op whose data moves some other
    way (mshpc/cpu_ranks/shared_buckets.py), recorded with the bytes it moves."""
    RECORDER.record(_name(group), op + peer, nbytes)
    phase = COMM_PREFIX + op
    with TIMERS.phase(phase):
        handle = issue()
    return handle if handle is None or not TIMERS.enabled else Timed(handle, phase)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False,
) -> Pending | None:
    """Collective over `group` (all ranks of the world when None)."""
    return collective(group, "all_reduce", tensor.numel() * tensor.element_size(),
                      lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Pending | None:
    """Collective over `group`; `src` is a global rank."""
    return collective(group, "broadcast", tensor.numel() * tensor.element_size(),
                      lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))


# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (same
# signatures, old names deprecated); torch 2.4 has only the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Transport(Protocol):
    """How reduce_scatter and all_gather move a group's bytes; collective over `group`. Returns
    the op's handle when `async_op`, else None once it is done."""

    name: str

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                       async_op: bool) -> Pending | None: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                   async_op: bool) -> Pending | None: ...


class TorchCollectives:
    """torch's own reduce-scatter and all-gather: NCCL's on GPU ranks, and the default."""

    name = "torch"

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                       async_op: bool) -> Pending | None:
        return _reduce_scatter_single(output, input, group=group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                   async_op: bool) -> Pending | None:
        return _all_gather_single(output, input, group=group, async_op=async_op)


_transport: Transport = TorchCollectives()


def use_transport(transport: Transport) -> None:
    """Carry this process's reduce-scatters and all-gathers with `transport` from now on: chosen
    once at start-up (mshpc/cpu_ranks/tunings.py), before any of them runs."""
    global _transport
    _transport = transport


def transport() -> Transport:
    """The transport this process's reduce-scatters and all-gathers use."""
    return _transport


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Collective over `group`: `output` (n elements) becomes the sum over ranks of chunk number
    `rank` of `input` (size * n elements, contiguous). On one rank it is a copy; returns None
    then, and whenever async_op is False."""
    size = dist.get_world_size(group)
    if size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return None
    return collective(group, "reduce_scatter", input.numel() * input.element_size(),
                      lambda: _transport.reduce_scatter(output, input, group, async_op))


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Collective over `group`: `output` (size * n elements, contiguous) becomes every rank's
    `input` (n elements), in rank order. On one rank it is a copy; returns None then, and
    whenever async_op is False."""
    size = dist.get_world_size(group)
    if size == 1:
        output.copy_(input.view_as(output))
        return None
    return collective(group, "all_gather", output.numel() * output.element_size(),
                      lambda: _transport.all_gather(output, input, group, async_op))


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> Pending:
    """Point-to-point: start sending `tensor` to global rank `dst` of `group`; the tensor must
    stay untouched until the returned work is waited on."""
    work = collective(group, "send", tensor.numel() * tensor.element_size(),
                      lambda: dist.isend(tensor, dst=dst, group=group), peer=f"->{dst}")
    assert work is not None  # isend is always asynchronous
    return work


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> Pending:
    """Point-to-point: start receiving into `tensor` from global rank `src` of `group`."""
    work = collective(group, "recv", tensor.numel() * tensor.element_size(),
                      lambda: dist.irecv(tensor, src=src, group=group), peer=f"<-{src}")
    assert work is not None  # irecv is always asynchronous
    return work


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Pending | None:
    """Collective over `group`: chunk j of `input` goes to rank j; chunk i of `output` comes from
    rank i (equal chunks, contiguous tensors)."""
    return collective(group, "all_to_all", input.numel() * input.element_size(),
                      lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op))


def all_to_all_v(
    output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
    group: dist.ProcessGroup | None = None, async_op: bool = False,
) -> Pending | None:
    """Collective over `group`: input_splits[j] rows (dim 0) of `input` go to rank j,
    output_splits[i] rows of `output` come from rank i, in rank order. Every rank must pass the
    sizes its peers pass for it. Recorded with the bytes this rank sends; returns the op's
    handle with async_op (both tensors must then stay untouched until it is waited on)."""
    return collective(group, "all_to_all_v", input.numel() * input.element_size(),
                      lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                                     async_op=async_op))


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """Point to point, called by this rank and each peer it names (global ranks): post every send
    and receive at once, so that two peers sending to each other do not deadlock, and wait."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends] + [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    peers = ",".join(str(peer) for _, peer in sends)
    nbytes = sum(t.numel() * t.element_size() for t, _ in sends)
    def post_and_wait() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    collective(None, "batch_isend_irecv", nbytes, post_and_wait, peer=f"->{peers}")


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group`."""
    collective(group, "barrier", 0, lambda: dist.barrier(group=group))


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
    count = torch.tensor([payload.numel()])
    collective(group, "all_gather", 8 * world, lambda: dist.all_gather(sizes, count, group=group))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    collective(group, "all_gather", longest * world, lambda: dist.all_gather(gathered, padded, group=group))
    return [json.loads(g[: int(n.item())].numpy().tobytes()) for g, n in zip(gathered, sizes, strict=True)]


def gather_json(value: Any, dst: int, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Collective over `group`: on global rank `dst`, every rank's JSON-able `value` in rank
    order; None on the others. Only `dst` receives, so the bytes grow as N, not as the N x N of
    `all_gather_json` (a checkpoint's manifest entries at 12,288 ranks). A gloo group."""
    payload = json.dumps(value).encode()
    longest = torch.tensor([len(payload)], dtype=torch.int64)
    all_reduce(longest, group=group, op=dist.ReduceOp.MAX)
    framed = torch.zeros(8 + int(longest.item()), dtype=torch.uint8)  # 8 bytes of length, then the JSON
    framed[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    if payload:
        framed[8:8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    me = dist.get_rank()
    gathered = [torch.empty_like(framed) for _ in range(dist.get_world_size(group))] if me == dst else None
    collective(group, "gather", framed.numel() * (len(gathered) if gathered else 1),
               lambda: dist.gather(framed, gathered, dst=dst, group=group))
    if gathered is None:
        return None
    return [json.loads(g[8:8 + int(g[:8].view(torch.int64).item())].numpy().tobytes()) for g in gathered]


def broadcast_json(value: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Collective over `group`: global rank `src`'s JSON-able `value` on every rank (the others
    pass anything, e.g. None). JSON, not pickle; the group must be a CPU (gloo) one."""
    payload = json.dumps(value).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast(size, src, group=group)
    data = torch.zeros(int(size.item()), dtype=torch.uint8)
    if payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    broadcast(data, src, group=group)
    return json.loads(data.numpy().tobytes())
