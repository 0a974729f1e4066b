"""Tensor and sequence parallelism (Megatron-LM: Shoeybi et al. 2019 sec. 3; Korthikanti et al.
2022 sec. 4.2.2), as autograd functions over the tp group.

Between the tensor-parallel regions the activations are split along the sequence: each tp rank
holds (b, s/tp, d), so norms, dropout and residual adds run on 1/tp of the tokens. A
column-parallel linear all-gathers its input along the sequence before its GEMM (its backward
reduce-scatters the input gradient); a row-parallel linear reduce-scatters its output after its
GEMM (its backward all-gathers the output gradient). Activations keep mshpc's (b, s, d) layout;
rank r's shard is positions [r * s/tp, (r + 1) * s/tp).

Overlap (MegaScale sec. 3.2): with `chunks` > 1 each rank's shard is cut into chunks along the
sequence; all chunk collectives are issued at once (asynchronously, in order), and the GEMM of
chunk k runs while chunk k+1 is still in flight. A GEMM treats rows independently, so this
reorders no sum: the weight gradients see the whole sequence in one GEMM in either mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mshpc.parallel import comm
from mshpc.parallel.tp_split import COLUMNS, ROWS, RowCopy, TpSplit, chunk_bounds

RowFn = Callable[[torch.Tensor], torch.Tensor]  # acts on the last dim only: rows are independent


def _wait(work: comm.Pending | None) -> None:
    if work is not None:
        work.wait()


def gather_seq(x: torch.Tensor, fn: RowFn | None, group: dist.ProcessGroup, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective over `group`: all-gather every rank's (b, s_l, ...) along the sequence and
    apply `fn` to each gathered chunk as it lands. Returns (fn(x_full) (b, tp * s_l, ...),
    x_full (b, tp * s_l, ...))."""
    tp, (b, s_l) = dist.get_world_size(group), x.shape[:2]
    bounds = chunk_bounds(s_l, chunks)
    pending = []
    for lo, hi in bounds:  # all issued first: chunk k+1 travels while chunk k computes
        piece = x[:, lo:hi].contiguous()  # (b, c, ...)
        landed = x.new_empty((tp, *piece.shape))  # (tp, b, c, ...)
        pending.append((comm.all_gather(landed, piece, group, async_op=True), landed))
    x_full = x.new_empty((b, tp, s_l, *x.shape[2:]))
    y_full: torch.Tensor | None = None
    for (lo, hi), (work, landed) in zip(bounds, pending, strict=True):
        _wait(work)
        x_full[:, :, lo:hi] = landed.transpose(0, 1)
        if fn is not None:
            y = fn(x_full[:, :, lo:hi])  # (b, tp, c, ...)
            if y_full is None:
                y_full = y.new_empty((b, tp, s_l, *y.shape[3:]))
            y_full[:, :, lo:hi] = y
    x_full = x_full.flatten(1, 2)
    return (x_full if y_full is None else y_full.flatten(1, 2)), x_full


def scatter_seq(x: torch.Tensor, fn: RowFn | None, group: dist.ProcessGroup, chunks: int,
                meanwhile: Callable[[], object] | None = None) -> torch.Tensor:
    """Collective over `group`: apply `fn` to the full-sequence x (b, s, ...) chunk by chunk and
    reduce-scatter each result along the sequence as soon as it is computed; run `meanwhile`
    while the last ones travel. Returns this rank's (b, s / tp, ...) of the sum over ranks."""
    tp, (b, s) = dist.get_world_size(group), x.shape[:2]
    rows = x.unflatten(1, (tp, s // tp))  # (b, tp, s_l, ...)
    out: torch.Tensor | None = None
    pending = []
    for lo, hi in chunk_bounds(s // tp, chunks):
        y = rows[:, :, lo:hi] if fn is None else fn(rows[:, :, lo:hi])  # (b, tp, c, ...)
        if out is None:
            out = y.new_empty((b, s // tp, *y.shape[3:]))
        send = y.transpose(0, 1).contiguous()  # (tp, b, c, ...): chunk r goes to rank r
        received = y.new_empty(send.shape[1:])  # (b, c, ...)
        pending.append((comm.reduce_scatter(received, send, group, async_op=True), received, lo, hi))
    assert out is not None
    if meanwhile is not None:
        meanwhile()
    for work, received, lo, hi in pending:
        _wait(work)
        out[:, lo:hi] = received
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Autocast's dtype where it is on, else x's. The GEMMs and their collectives both run in it:
    under bf16 autocast the sequence all-gathers move half the bytes of fp32. These functions
    cast for themselves because autocast does not reach a custom backward."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def sum_copies(dw: torch.Tensor, copies: list[RowCopy], group: dist.ProcessGroup) -> torch.Tensor:
    """dw (rows_l, in) with each replicated unit's rows summed over the ranks that hold a copy of
    it: every rank puts its rows in its unit's slot of one buffer, zeros elsewhere, and a single
    all-reduce over `group` sums each slot over its holders only. Collective over `group`."""
    slots, at = [], 0
    for c in copies:
        slots.append(at + c.unit * (c.hi - c.lo))
        at += c.units * (c.hi - c.lo)
    buf = dw.new_zeros((at, dw.shape[1]))  # small: the replicated kv heads, whole, once each
    for c, slot in zip(copies, slots, strict=True):
        buf[slot:slot + c.hi - c.lo] = dw[c.lo:c.hi]
    comm.all_reduce(buf, group=group)
    dw = dw.clone()
    for c, slot in zip(copies, slots, strict=True):
        dw[c.lo:c.hi] = buf[slot:slot + c.hi - c.lo]
    return dw


class _GatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T; backward: dx = reduce_scatter_seq(dy @ W), dW = dy^T x_full,
    its replicated rows (`copies`) summed over the ranks that share them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup, chunks: int,
                copies: list[RowCopy]) -> torch.Tensor:
        dtype = _compute_dtype(x)
        w = weight.to(dtype)
        y, x_full = gather_seq(x.to(dtype), lambda t: F.linear(t, w), group, chunks)
        ctx.save_for_backward(x_full, weight)
        ctx.group, ctx.chunks, ctx.x_dtype, ctx.copies = group, chunks, x.dtype, copies
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_full, weight = ctx.saved_tensors
        dy, w = dy.contiguous().to(x_full.dtype), weight.to(x_full.dtype)
        dw: list[torch.Tensor] = []  # (out_l, in): one GEMM over the whole sequence, while dx travels
        dx = scatter_seq(dy, lambda t: t.matmul(w), ctx.group, ctx.chunks,
                         meanwhile=lambda: dw.append(_rows(dy).t().matmul(_rows(x_full))))
        if ctx.copies:
            dw[0] = sum_copies(dw[0], ctx.copies, ctx.group)
        return dx.to(ctx.x_dtype), dw[0].to(weight.dtype), None, None, None


class _LinearScatter(torch.autograd.Function):
    """y = reduce_scatter_seq(x @ W^T); backward: dy_full = all_gather_seq(dy), dx = dy_full @ W,
    dW = dy_full^T x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup, chunks: int) -> torch.Tensor:
        dtype = _compute_dtype(x)
        x_in, w = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x_in, weight)
        ctx.group, ctx.chunks, ctx.x_dtype = group, chunks, x.dtype
        return scatter_seq(x_in, lambda t: F.linear(t, w), group, chunks)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        w = weight.to(x.dtype)
        dx, dy_full = gather_seq(dy.contiguous().to(x.dtype), lambda t: t.matmul(w), ctx.group, ctx.chunks)
        dw = _rows(dy_full).t().matmul(_rows(x))  # (out, in_l)
        return dx.to(ctx.x_dtype), dw.to(weight.dtype), None, None


class _ScatterSum(torch.autograd.Function):
    """Sum over ranks, keep this rank's part of the sequence; backward: all-gather it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return scatter_seq(x, None, group, 1)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return gather_seq(dy.contiguous(), None, ctx.group, 1)[0], None


class ColumnParallelLinear(nn.Module):
    """x (b, s/tp, in) -> (b, s, out/tp): all-gather along the sequence, then this rank's rows of
    the weight. Collective over `group` in forward and backward."""

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup, chunks: int = 1,
                 split: TpSplit = ROWS) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (out/tp, in)
        self.group, self.chunks = group, chunks
        self.split = split  # how the whole weight was cut (qkv: per block), for resharding
        # rows this rank holds a copy of (kv heads fewer than tp): their gradients are summed
        self.copies = split.copies(dist.get_rank(group), dist.get_world_size(group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherLinear.apply(x, self.weight, self.group, self.chunks, self.copies)


class RowParallelLinear(nn.Module):
    """x (b, s, in/tp) -> (b, s/tp, out): this rank's columns of the weight, then the sum over
    ranks reduce-scattered along the sequence. Collective over `group` in forward and backward."""

    split = COLUMNS

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup, chunks: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (out, in/tp)
        self.group, self.chunks = group, chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearScatter.apply(x, self.weight, self.group, self.chunks)


class VocabParallelEmbedding(nn.Module):
    """Token ids (b, s), the same on every tp rank -> embeddings (b, s/tp, d). This rank holds rows
    [vocab_start, vocab_start + rows) of the table; a token outside them contributes zeros, and
    the sum over ranks is reduce-scattered along the sequence (Megatron's SP embedding)."""

    split = ROWS

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (rows, d)
        self.vocab_start, self.group = vocab_start, group

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        partial = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        partial = partial * mine.unsqueeze(-1).to(partial.dtype)  # (b, s, d)
        return _ScatterSum.apply(partial, self.group)


class _VocabParallelNLL(torch.autograd.Function):
    """-log softmax(logits)[target] per row, with the vocabulary split over `group`: logits
    (n, V_l) are columns [vocab_start, vocab_start + V_l). Three all-reduces of (n,): the max,
    the target logit and the sum of exponentials (Megatron's vocab-parallel cross-entropy)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        top = logits.max(dim=-1).values  # (n,)
        comm.all_reduce(top, group=group, op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)  # the max subtracted: exp cannot overflow
        local = target - vocab_start
        mine = (local >= 0) & (local < logits.shape[-1])
        picked = shifted.gather(1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(1)).squeeze(1)
        picked = torch.where(mine, picked, torch.zeros_like(picked))
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(picked, group=group)
        comm.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp, sum_exp, local, mine)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        exp, sum_exp, local, mine = ctx.saved_tensors
        dlogits = exp / sum_exp.unsqueeze(-1)  # softmax, this rank's columns
        rows = torch.arange(dlogits.shape[0], device=dlogits.device)[mine]
        dlogits[rows, local[mine]] -= 1.0
        return dlogits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group: dist.ProcessGroup, ignore_index: int = -100) -> torch.Tensor:
    """F.cross_entropy's mean over targets != ignore_index, for logits (b, s, V_l) split over the
    vocabulary. Collective over `group`; every tp rank gets the same loss."""
    target = targets.flatten()
    nll = _VocabParallelNLL.apply(logits.float().flatten(0, 1), target, vocab_start, group)
    valid = target != ignore_index
    return torch.where(valid, nll, torch.zeros_like(nll)).sum() / valid.sum()
