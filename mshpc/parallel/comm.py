"""Every collective mshpc issues goes through here, so the flight recorder and the phase timers
see all of them: each wrapper issues its op through `_collective`.

The recorder is a small per-process ring buffer of (sequence number, group, op, bytes): on a
hang it tells which collective each rank last entered. The timers time each op as the phase
"comm.<op>" (mshpc/diagnose/timers.py): the call, and for an async op the wait on its handle.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

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
        self._fail: str | None = None

    def record(self, group: str, op: str, nbytes: int) -> None:
        with self._lock:
            self._seq += 1
            self._records.append(CollectiveRecord(self._seq, group, op, nbytes))
            self._counts[group] = self._counts.get(group, 0) + 1
        if self._fail is not None:  # the one check a run with no armed fault pays per collective
            self._fail_now()

    def counts(self) -> dict[str, int]:
        """Collectives entered per group: equal on every member of a group unless one is missing
        from the group's latest collective (what a hang report compares across ranks)."""
        with self._lock:
            return dict(self._counts)

    def fail_next(self, message: str) -> None:
        """Fault injection (the raise_in_collective test fault, armed through FaultHooks.at_step):
        the next collective this process enters raises RuntimeError, once."""
        with self._lock:
            self._fail = message

    def _fail_now(self) -> None:
        # under the lock: of two threads entering collectives at once, only one raises
        with self._lock:
            fail, self._fail = self._fail, None
        if fail is not None:
            raise RuntimeError(fail)

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


def _collective(
    group: dist.ProcessGroup | None, op: str, nbytes: int, issue: Callable[[], _Handle], peer: str = ""
) -> _Handle | Timed:
    """The one door of every op here: record it for the flight recorder (point-to-point ops
    with their `peer`, e.g. "send->3"), time it as phase "comm.<op>", and return its handle
    (None for a blocking op) with a timed wait()."""
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
    return _collective(group, "all_reduce", tensor.numel() * tensor.element_size(),
                       lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Pending | None:
    """Collective over `group`; `src` is a global rank."""
    return _collective(group, "broadcast", tensor.numel() * tensor.element_size(),
                       lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))


# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (same
# signatures, old names deprecated); torch 2.4 has only the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# one gloo op of a collective, and the local step (a sum) that runs once it is done
_Part = tuple[dist.Work, Callable[[], object] | None]


class Pieces:
    """An async collective issued as several gloo ops, some with a local step that completes
    them (a sum). wait() runs those steps on the waiting thread: done as callbacks, they would
    hold one of gloo's threads until the GIL came free, stalling the ops queued behind."""

    def __init__(self, parts: list[_Part]) -> None:
        self._parts = parts

    def wait(self) -> bool:
        for work, finish in self._parts:
            work.wait()
            if finish is not None:
                finish()
        self._parts = []
        return True


# What an async collective returns; each kind has wait().
Pending = dist.Work | Pieces | Timed

# Gloo moves one large message per peer at ~2/3 of the link rate when both directions are busy;
# messages of at most this size reach it. Measured, 2 ranks over a 1 Gbit/s veth, 4 MiB to each
# peer (ideal 0.034 s): all_to_all 0.049 s whole, 0.037 s in 512 KiB pieces; all_gather 0.043-
# 0.051 s whole, 0.036 s in pieces. The point-to-point sends that replaced both move their
# pieces at the link's rate too (benchmarks/dp_overlap.py: 8 MiB each way in 0.069 s).
GLOO_MESSAGE_BYTES = 512 * 1024


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
    return _collective(group, "reduce_scatter", input.numel() * input.element_size(),
                       lambda: _reduce_scatter(output, input, size, group, async_op))


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, size: int, group: dist.ProcessGroup | None,
                    async_op: bool) -> Pending | None:
    if dist.get_backend(group) == "gloo":
        return _finish(_reduce_scatter_gloo(output.view(-1), input.view(size, -1), group), async_op)
    return _reduce_scatter_single(output, input, group=group, async_op=async_op)


def _reduce_scatter_gloo(output: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup | None) -> Pieces:
    # Gloo's own reduce_scatter (list, _tensor and _single alike) takes as long as a full
    # all_reduce of the input. Point-to-point sends move each rank only its chunk, (size-1)/size
    # of the input, as a ring reduce-scatter does, straight from the input's rows (all_to_all
    # copied every piece into a send buffer first, and gloo copies this rank's own chunk through
    # its own buffer); the sum is local. CPU per 200 MiB in 25 MiB buckets, 2 ranks on loopback
    # (benchmarks/gloo_collectives.py): all_to_all 145 ms, point-to-point 70 ms, DDP's all_reduce
    # 84-113 ms for all of it.
    me, peers = peers_of(group)
    parts: list[_Part] = []
    for lo, hi in _pieces(rows.shape[1], rows.element_size()):
        own = rows[me, lo:hi]
        finish: Callable[[], object]
        if len(peers) == 1:  # the sum of two rows is one add, bitwise the same in either order
            received = torch.empty_like(own)
            into = [received]
            finish = functools.partial(torch.add, own, received, out=output[lo:hi])
        else:
            received = torch.empty(rows.shape[0], hi - lo, dtype=rows.dtype, device=rows.device)
            into = [received[j] for j, _ in peers]
            finish = functools.partial(_sum_rows, received, me, own, output[lo:hi])
        moves = [(rows[j, lo:hi], buffer, peer) for (j, peer), buffer in zip(peers, into, strict=True)]
        parts += _exchange(moves, group, finish)
    return Pieces(parts)


def _sum_rows(received: torch.Tensor, me: int, own: torch.Tensor, out: torch.Tensor) -> None:
    received[me].copy_(own)  # summed in rank order, as gloo's own reduction did
    torch.sum(received, dim=0, out=out)


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
    return _collective(group, "all_gather", output.numel() * output.element_size(),
                       lambda: _all_gather(output, input, size, group, async_op))


def _all_gather(output: torch.Tensor, input: torch.Tensor, size: int, group: dist.ProcessGroup | None,
                async_op: bool) -> Pending | None:
    if dist.get_backend(group) == "gloo":
        return _finish(_all_gather_gloo(output.view(size, -1), input.reshape(-1), group), async_op)
    return _all_gather_single(output, input, group=group, async_op=async_op)


def _all_gather_gloo(rows: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None) -> Pieces:
    # Point-to-point, each peer's piece received straight into its row of the output: gloo's
    # all_gather goes through a flat buffer that is then copied out. CPU per 200 MiB in 25 MiB
    # buckets, 2 ranks on loopback (benchmarks/gloo_collectives.py): 148 ms, 68 ms point-to-point.
    me, peers = peers_of(group)
    if rows[me].data_ptr() != input.data_ptr():
        rows[me].copy_(input)
    parts: list[_Part] = []
    for lo, hi in _pieces(input.numel(), input.element_size()):
        parts += _exchange([(input[lo:hi], rows[j, lo:hi], peer) for j, peer in peers], group)
    return Pieces(parts)


def peers_of(group: dist.ProcessGroup | None) -> tuple[int, list[tuple[int, int]]]:
    """This rank's index in `group`, and every other member as (index, global rank)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    me = dist.get_rank(group)
    return me, [(j, rank) for j, rank in enumerate(ranks) if j != me]


# The tag of the sends that make up a collective: apart from the plain point-to-point ops
# (isend, irecv, exchange: tag 0) that another part of a run may post on the same group.
_COLLECTIVE_TAG = 1


def _exchange(moves: list[tuple[torch.Tensor, torch.Tensor, int]], group: dist.ProcessGroup | None,
              finish: Callable[[], object] | None = None) -> list[_Part]:
    # (send, receive into, peer): both posted before either is waited on, so two peers sending
    # to each other cannot deadlock; each (pair, tag) delivers in the order posted, and every
    # rank posts the same pieces in the same order. `finish` runs once all of them are done.
    works: list[dist.Work] = []
    for send, receive, peer in moves:
        for work in (dist.isend(send, dst=peer, group=group, tag=_COLLECTIVE_TAG),
                     dist.irecv(receive, src=peer, group=group, tag=_COLLECTIVE_TAG)):
            assert work is not None  # None only for a rank outside the group
            works.append(work)
    return [(w, None) for w in works[:-1]] + [(works[-1], finish)]


def signal_peers(group: dist.ProcessGroup | None, op: str, nbytes: int, peers: Sequence[tuple[int, int]],
                 finish: Callable[[], object]) -> Pending:
    """Async: a one-byte "ready" to and from each of `peers` ((index, global rank) in group order,
    as peers_of gives them), then `finish` on the waiting thread. For a collective whose data
    moves some other way (mshpc/parallel/host_shared.py); recorded and timed as `op` of `nbytes`."""
    def post() -> Pieces:
        ready = torch.ones(1, dtype=torch.uint8)
        moves = [(ready, torch.empty(1, dtype=torch.uint8), peer) for _, peer in peers]
        return Pieces(_exchange(moves, group, finish))
    return _collective(group, op, nbytes, post)


def _pieces(numel: int, element_size: int) -> list[tuple[int, int]]:
    step = max(1, GLOO_MESSAGE_BYTES // element_size)
    return [(lo, min(numel, lo + step)) for lo in range(0, numel, step)]


def _finish(done: Pieces, async_op: bool) -> Pieces | None:
    if async_op:
        return done
    done.wait()
    return None


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> Pending:
    """Point-to-point: start sending `tensor` to global rank `dst` of `group`; the tensor must
    stay untouched until the returned work is waited on."""
    work = _collective(group, "send", tensor.numel() * tensor.element_size(),
                       lambda: dist.isend(tensor, dst=dst, group=group), peer=f"->{dst}")
    assert work is not None  # isend is always asynchronous
    return work


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> Pending:
    """Point-to-point: start receiving into `tensor` from global rank `src` of `group`."""
    work = _collective(group, "recv", tensor.numel() * tensor.element_size(),
                       lambda: dist.irecv(tensor, src=src, group=group), peer=f"<-{src}")
    assert work is not None  # irecv is always asynchronous
    return work


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Pending | None:
    """Collective over `group`: chunk j of `input` goes to rank j; chunk i of `output` comes from
    rank i (equal chunks, contiguous tensors)."""
    return _collective(group, "all_to_all", input.numel() * input.element_size(),
                       lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op))


def all_to_all_v(
    output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Collective over `group`, blocking: input_splits[j] rows (dim 0) of `input` go to rank j,
    output_splits[i] rows of `output` come from rank i, in rank order. Every rank must pass the
    sizes its peers pass for it. Recorded with the bytes this rank sends."""
    _collective(group, "all_to_all_v", input.numel() * input.element_size(),
                lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=group))


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """Point to point, called by this rank and each peer it names (global ranks): post every send
    and receive at once, so that two peers sending to each other do not deadlock, and wait."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends] + [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    peers = ",".join(str(peer) for _, peer in sends)
    nbytes = sum(t.numel() * t.element_size() for t, _ in sends)
    def post_and_wait() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    _collective(None, "batch_isend_irecv", nbytes, post_and_wait, peer=f"->{peers}")


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group`."""
    _collective(group, "barrier", 0, lambda: dist.barrier(group=group))


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
    _collective(group, "all_gather", 8 * world, lambda: dist.all_gather(sizes, count, group=group))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    _collective(group, "all_gather", longest * world, lambda: dist.all_gather(gathered, padded, group=group))
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
    _collective(group, "gather", framed.numel() * (len(gathered) if gathered else 1),
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
