"""Gloo's reduce-scatter and all-gather as point-to-point sends: the transport comm.py uses on CPU
ranks (installed by tunings.py at start-up; a GPU rank keeps NCCL's own collectives).

Why: gloo's own reduce_scatter (list, _tensor and _single alike) takes as long as a full
all_reduce of the input, and its all_gather goes through a flat buffer that is then copied out.
Point-to-point sends move each rank only its chunk, (size-1)/size of the input, as a ring
reduce-scatter does, straight from the input's rows and into the output's; the sum is local.
CPU per 200 MiB in 25 MiB buckets, 2 ranks on loopback (benchmarks/gloo_collectives.py):
reduce-scatter as all_to_all 145 ms, point-to-point 70 ms, DDP's all_reduce 84-113 ms for all of
it; all-gather 148 ms, 68 ms point-to-point.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

# Gloo moves one large message per peer at ~2/3 of the link rate when both directions are busy;
# messages of at most this size reach it. Measured, 2 ranks over a 1 Gbit/s veth, 4 MiB to each
# peer (ideal 0.034 s): all_to_all 0.049 s whole, 0.037 s in 512 KiB pieces; all_gather 0.043-
# 0.051 s whole, 0.036 s in pieces. The point-to-point sends move their pieces at the link's
# rate too (benchmarks/dp_overlap.py: 8 MiB each way in 0.069 s).
GLOO_MESSAGE_BYTES = 512 * 1024

# The tag of the sends that make up a collective: apart from the plain point-to-point ops
# (comm.isend, irecv, exchange: tag 0) that another part of a run may post on the same group.
COLLECTIVE_TAG = 1

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


class GlooPointToPoint:
    """comm.Transport for gloo groups: each collective a `Pieces` of point-to-point sends."""

    name = "gloo point-to-point"

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                       async_op: bool) -> Pieces | None:
        size = dist.get_world_size(group)
        return _finish(reduce_scatter(output.view(-1), input.view(size, -1), group), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                   async_op: bool) -> Pieces | None:
        size = dist.get_world_size(group)
        return _finish(all_gather(output.view(size, -1), input.reshape(-1), group), async_op)


def reduce_scatter(output: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup | None) -> Pieces:
    """`output` becomes the sum over members of row `me` of their `rows` (size, n), summed in rank
    order as gloo's own reduction did. Collective over `group`."""
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
        parts += exchange(moves, group, finish)
    return Pieces(parts)


def _sum_rows(received: torch.Tensor, me: int, own: torch.Tensor, out: torch.Tensor) -> None:
    received[me].copy_(own)  # summed in rank order, as gloo's own reduction did
    torch.sum(received, dim=0, out=out)


def all_gather(rows: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None) -> Pieces:
    """Row j of `rows` (size, n) becomes member j's `input`, each peer's piece received straight
    into its row. Collective over `group`."""
    me, peers = peers_of(group)
    if rows[me].data_ptr() != input.data_ptr():
        rows[me].copy_(input)
    parts: list[_Part] = []
    for lo, hi in _pieces(input.numel(), input.element_size()):
        parts += exchange([(input[lo:hi], rows[j, lo:hi], peer) for j, peer in peers], group)
    return Pieces(parts)


def peers_of(group: dist.ProcessGroup | None) -> tuple[int, list[tuple[int, int]]]:
    """This rank's index in `group`, and every other member as (index, global rank)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    me = dist.get_rank(group)
    return me, [(j, rank) for j, rank in enumerate(ranks) if j != me]


def exchange(moves: list[tuple[torch.Tensor, torch.Tensor, int]], group: dist.ProcessGroup | None,
             finish: Callable[[], object] | None = None) -> list[_Part]:
    """Post (send, receive into, peer) for each move, both before either is waited on, so two
    peers sending to each other cannot deadlock; each (pair, tag) delivers in the order posted,
    and every rank posts the same pieces in the same order. `finish` runs once all are done."""
    works: list[dist.Work] = []
    for send, receive, peer in moves:
        for work in (dist.isend(send, dst=peer, group=group, tag=COLLECTIVE_TAG),
                     dist.irecv(receive, src=peer, group=group, tag=COLLECTIVE_TAG)):
            assert work is not None  # None only for a rank outside the group
            works.append(work)
    return [(w, None) for w in works[:-1]] + [(works[-1], finish)]


def _pieces(numel: int, element_size: int) -> list[tuple[int, int]]:
    step = max(1, GLOO_MESSAGE_BYTES // element_size)
    return [(lo, min(numel, lo + step)) for lo in range(0, numel, step)]


def _finish(done: Pieces, async_op: bool) -> Pieces | None:
    if async_op:
        return done
    done.wait()
    return None
