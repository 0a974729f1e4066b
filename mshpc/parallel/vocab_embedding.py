"""The vocab-parallel token embedding under sequence parallelism, sending only the rows that
change hands.

Megatron-Core embeds every position with this rank's rows of the table (zeros for the tokens
other ranks hold) and reduce-scatters the (b, s, d) partial sums into the sequence-parallel
layout; its backward all-gathers the (b, s/tp, d) output gradient. Each rank then sends
(tp - 1)/tp of a (b, s, d) tensor each way, although every position has exactly one nonzero
term. The token ids are on every tp rank, so each rank knows which rows the others need
without being told: here rank r sends rank q only the rows of q's positions whose tokens r's
part of the vocabulary holds, and backward sends back only their gradients (one
uneven all-to-all each way, `comm.all_to_all_v`). Each position's row travels at most once, so
the ranks together send at most 1/tp of Megatron's bytes, and no rank more than its own share
there, whatever the token distribution (tokens spread evenly over the vocabulary parts: each
rank 1/tp of its share). The sums it skips were sums with zeros, so the numbers are bitwise
Megatron's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mshpc.parallel import comm
from mshpc.parallel.tp_split import ROWS, chunk_bounds


def vocab_owner(idx: torch.Tensor, vocab_size: int, tp: int) -> torch.Tensor:
    """The tp rank whose part of the table holds each token of idx (b, s), as `chunk_bounds`
    splits the vocabulary; -1 for an id outside it (its embedding stays zeros, as the
    reduce-scatter of partial sums gave it)."""
    starts = torch.tensor([lo for lo, _ in chunk_bounds(vocab_size, tp)[1:]], device=idx.device, dtype=idx.dtype)
    owner = torch.bucketize(idx, starts, right=True)
    return torch.where((idx >= 0) & (idx < vocab_size), owner, torch.full_like(owner, -1))


def _counts(mask_by_rank: torch.Tensor, tp: int, me: int) -> list[int]:
    """Rows per peer, 0 for this rank itself (its rows never travel). One host sync on a GPU:
    the all-to-all needs its split sizes on the host."""
    counts = mask_by_rank.flatten(1).sum(dim=1).tolist()
    return [0 if q == me else int(n) for q, n in enumerate(counts)]


def _exchange(rows_by_peer: list[torch.Tensor], recv_counts: list[int], d: int,
              group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Collective over `group`: send rows_by_peer[q] (n_q, d) to rank q, return the rows each
    rank q sent here, (recv_counts[q], d) each."""
    send = torch.cat(rows_by_peer)
    received = send.new_empty((sum(recv_counts), d))
    comm.all_to_all_v(received, send, recv_counts, [len(r) for r in rows_by_peer], group)
    return list(received.split(recv_counts))


class _SparseEmbed(torch.autograd.Function):
    """ids (b, s) -> this rank's (b, s/tp, d) of the embedding, the table split over the
    vocabulary; backward: the table part's gradient from the output gradients of every
    position whose token it holds."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, idx: torch.Tensor, vocab_start: int, vocab_size: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        tp, me = dist.get_world_size(group), dist.get_rank(group)
        b, s = idx.shape
        owner = vocab_owner(idx, vocab_size, tp).view(b, tp, s // tp)  # (b, tp, s_l) by sequence shard
        theirs = owner == me  # (b, tp, s_l): positions anywhere whose rows this rank holds
        local = idx.view(b, tp, s // tp) - vocab_start
        rows_by_peer = [weight[local[:, q][theirs[:, q]]] if q != me else weight[:0] for q in range(tp)]
        mine = owner[:, me]  # (b, s_l): who holds each of this rank's positions
        recv_counts = _counts(torch.stack([mine == q for q in range(tp)]), tp, me)
        received = _exchange(rows_by_peer, recv_counts, weight.shape[1], group)
        out = weight.new_zeros((b, s // tp, weight.shape[1]))
        out[mine == me] = weight[local[:, me][mine == me]]
        for q in range(tp):
            if q != me:
                out[mine == q] = received[q]
        ctx.save_for_backward(idx)
        ctx.vocab_start, ctx.vocab_size, ctx.group, ctx.rows = vocab_start, vocab_size, group, weight.shape[0]
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (idx,) = ctx.saved_tensors
        tp, me = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        b, s = idx.shape
        owner = vocab_owner(idx, ctx.vocab_size, tp)  # (b, s)
        by_shard = owner.view(b, tp, s // tp)
        mine = by_shard[:, me]  # (b, s_l)
        dy = dy.contiguous()
        rows_by_peer = [dy[mine == q] if q != me else dy[:0, 0] for q in range(tp)]
        recv_counts = _counts((by_shard == me).transpose(0, 1), tp, me)
        received = _exchange(rows_by_peer, recv_counts, dy.shape[-1], ctx.group)
        received[me] = dy[mine == me]
        # the gradient rows of every position this rank's tokens sit at, in (b, s) order, so each
        # table row sums them in the order nn.Embedding's backward does (bitwise the same)
        held = owner == me  # (b, s)
        shard_of = (held.nonzero()[:, 1] // (s // tp))  # (m,): the rank each of those rows came from
        rows = dy.new_empty((int(shard_of.numel()), dy.shape[-1]))
        for q in range(tp):
            rows[shard_of == q] = received[q]
        dw = torch.ops.aten.embedding_dense_backward(rows, idx[held] - ctx.vocab_start, ctx.rows, -1, False)
        return dw, None, None, None, None


class VocabParallelEmbedding(nn.Module):
    """Token ids (b, s), the same on every tp rank -> embeddings (b, s/tp, d). This rank holds rows
    [vocab_start, vocab_start + rows) of the table, `chunk_bounds`'s part of `vocab_size`.
    Collective over `group` in forward and backward."""

    split = ROWS

    def __init__(self, weight: torch.Tensor, vocab_size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (rows, d)
        self.vocab_size, self.group = vocab_size, group
        self.vocab_start = chunk_bounds(vocab_size, dist.get_world_size(group))[dist.get_rank(group)][0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _SparseEmbed.apply(self.weight, idx, self.vocab_start, self.vocab_size, self.group)
