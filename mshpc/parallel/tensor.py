"""Tensor and sequence parallelism (Megatron-LM: Shoeybi et al. 2019 sec. 3; Korthikanti et al.
2022 sec. 4.2.2), as autograd functions over the tp group.

Between the tensor-parallel regions the activations are split along the sequence: each tp rank
holds (b, s/tp, d), so norms, dropout and residual adds run on 1/tp of the tokens. A
column-parallel linear all-gathers its input along the sequence before its GEMM but saves only
its own shard, which backward gathers again while the input-gradient GEMMs run (Megatron-Core's
way; its backward reduce-scatters the input gradient); a row-parallel linear reduce-scatters its output after its
GEMM (its backward all-gathers the output gradient). Activations keep mshpc's (b, s, d) layout;
rank r's shard is positions [r * s/tp, (r + 1) * s/tp).

Overlap (MegaScale sec. 3.2): with `chunks` > 1 each rank's shard is cut into chunks along the
sequence; all chunk collectives are issued at once (asynchronously, in order), and the GEMM of
chunk k runs while chunk k+1 is still in flight. A GEMM treats rows independently, so this
reorders no sum: the weight gradients see the whole sequence in one GEMM in either mode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
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


Gathering = list[tuple[int, int, "comm.Pending | None", torch.Tensor]]  # (lo, hi, work, landed) per chunk


def start_gather(x: torch.Tensor, group: dist.ProcessGroup, chunks: int) -> Gathering:
    """Collective over `group`: issue the all-gathers of every chunk of this rank's (b, s_l, ...)
    along the sequence at once, asynchronously, in order; `land_gather` finishes them."""
    tp = dist.get_world_size(group)
    pending: Gathering = []
    for lo, hi in chunk_bounds(x.shape[1], chunks):  # all issued first: chunk k+1 travels while chunk k computes
        piece = x[:, lo:hi].contiguous()  # (b, c, ...)
        landed = x.new_empty((tp, *piece.shape))  # (tp, b, c, ...)
        pending.append((lo, hi, comm.all_gather(landed, piece, group, async_op=True), landed))
    return pending


def land_gather(x: torch.Tensor, pending: Gathering, fns: Sequence[RowFn] = ()) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Wait for `start_gather`'s chunks in order, applying each of `fns` to each chunk as it
    lands. Returns ([fn(x_full) (b, tp * s_l, ...) per fn], x_full (b, tp * s_l, ...))."""
    tp, (b, s_l) = pending[0][3].shape[0], x.shape[:2]
    x_full = x.new_empty((b, tp, s_l, *x.shape[2:]))
    ys: list[torch.Tensor | None] = [None] * len(fns)
    for lo, hi, work, landed in pending:
        _wait(work)
        x_full[:, :, lo:hi] = landed.transpose(0, 1)
        for i, fn in enumerate(fns):
            y = fn(x_full[:, :, lo:hi])  # (b, tp, c, ...)
            if ys[i] is None:
                ys[i] = y.new_empty((b, tp, s_l, *y.shape[3:]))
            ys[i][:, :, lo:hi] = y  # type: ignore[index]
    return [y.flatten(1, 2) for y in ys if y is not None], x_full.flatten(1, 2)


def gather_seq(x: torch.Tensor, fn: RowFn | None, group: dist.ProcessGroup, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective over `group`: all-gather every rank's (b, s_l, ...) along the sequence and
    apply `fn` to each gathered chunk as it lands. Returns (fn(x_full) (b, tp * s_l, ...),
    x_full (b, tp * s_l, ...))."""
    ys, x_full = land_gather(x, start_gather(x, group, chunks), () if fn is None else (fn,))
    return (ys[0] if ys else x_full), x_full


def scatter_seq(x: torch.Tensor, fn: RowFn | None, group: dist.ProcessGroup, chunks: int,
                meanwhile: Callable[[], object] | None = None) -> torch.Tensor:
    """Collective over `group`: apply `fn` to the full-sequence x (b, s, ...) chunk by chunk and
    reduce-scatter each result along the sequence as soon as it is computed; run `meanwhile`
    while the last ones travel. Returns this rank's (b, s / tp, ...) of the sum over ranks."""
    tp, s = dist.get_world_size(group), x.shape[1]
    rows = x.unflatten(1, (tp, s // tp))  # (b, tp, s_l, ...)
    return scatter_chunks(lambda lo, hi: rows[:, :, lo:hi] if fn is None else fn(rows[:, :, lo:hi]),
                          x.shape[0], s // tp, group, chunks, meanwhile)


def scatter_chunks(chunk: Callable[[int, int], torch.Tensor], b: int, s_l: int, group: dist.ProcessGroup,
                   chunks: int, meanwhile: Callable[[], object] | None = None) -> torch.Tensor:
    """scatter_seq's loop: `chunk(lo, hi)` computes positions [lo, hi) of every rank's part,
    (b, tp, hi - lo, ...), which is reduce-scattered at once; `meanwhile` runs while the last
    ones travel. Returns this rank's (b, s_l, ...) of the sum over ranks."""
    out: torch.Tensor | None = None
    pending = []
    for lo, hi in chunk_bounds(s_l, chunks):
        y = chunk(lo, hi)  # (b, tp, c, ...)
        if out is None:
            out = y.new_empty((b, s_l, *y.shape[3:]))
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
    """y_i = all_gather_seq(x) @ W_i^T for each weight, behind ONE all-gather of x. Saves only
    this rank's shard of x (Korthikanti et al. 2022 sec. 4.2.2: the sequence-parallel input is
    kept at 1/tp and gathered again in backward); backward: dx = reduce_scatter_seq(sum_i
    dy_i @ W_i), its GEMMs running while x travels again, and dW_i = dy_i^T x_full while dx travels,
    the rows of W_i that several ranks hold copies of (`copies[i]`: kv heads fewer than tp) summed
    over those ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, chunks: int,
                copies: tuple[list[RowCopy], ...], *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dtype = _compute_dtype(x)
        x_in, ws = x.to(dtype), [w.to(dtype) for w in weights]
        ys, _ = land_gather(x_in, start_gather(x_in, group, chunks), [functools.partial(F.linear, weight=w) for w in ws])
        ctx.save_for_backward(x_in, *weights)  # the (b, s/tp, in) shard, not the gathered input
        ctx.group, ctx.chunks, ctx.x_dtype, ctx.copies = group, chunks, x.dtype, copies
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *dys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        regather = start_gather(x, ctx.group, ctx.chunks)  # travels while dx's GEMMs run
        tp = dist.get_world_size(ctx.group)
        dys = tuple(dy.contiguous().to(x.dtype) for dy in dys)
        ws = [w.to(x.dtype) for w in weights]
        rows = [dy.unflatten(1, (tp, -1)) for dy in dys]  # (b, tp, s_l, out_i)

        def dx_chunk(lo: int, hi: int) -> torch.Tensor:  # (b, tp, c, in): sum_i dy_i @ W_i
            out = rows[0][:, :, lo:hi].matmul(ws[0])
            for r, w in zip(rows[1:], ws[1:], strict=True):
                out += r[:, :, lo:hi].matmul(w)
            return out

        dw: list[torch.Tensor] = []  # (out_i, in): one GEMM over the whole sequence, while dx travels

        def weight_grads() -> None:
            x_full = land_gather(x, regather)[1]  # (b, s, in)
            dw.extend(_rows(dy).t().matmul(_rows(x_full)) for dy in dys)

        dx = scatter_chunks(dx_chunk, x.shape[0], x.shape[1], ctx.group, ctx.chunks, meanwhile=weight_grads)
        dw = [sum_copies(g, c, ctx.group) if c else g for g, c in zip(dw, ctx.copies, strict=True)]
        return (dx.to(ctx.x_dtype), None, None, None, *(g.to(w.dtype) for g, w in zip(dw, weights, strict=True)))


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


class _LinearsScatterSum(torch.autograd.Function):
    """y = reduce_scatter_seq(sum_i x_i @ W_i^T), chunk by chunk: chunk k's GEMMs run while
    chunk k-1's reduce-scatter travels (the fused parallel block's attention and MLP
    projections, MegaScale sec. 3.1-3.2). Backward: dy_full = all_gather_seq(dy), each
    dx_i = dy_full @ W_i as its chunk lands, dW_i = dy_full^T x_i."""

    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup, chunks: int, n: int, *xs_ws: torch.Tensor) -> torch.Tensor:
        xs, weights = xs_ws[:n], xs_ws[n:]
        dtype = _compute_dtype(xs[0])
        xs_in, ws = [x.to(dtype) for x in xs], [w.to(dtype) for w in weights]
        ctx.save_for_backward(*xs_in, *weights)
        ctx.group, ctx.chunks, ctx.n, ctx.x_dtypes = group, chunks, n, [x.dtype for x in xs]
        tp, s = dist.get_world_size(group), xs[0].shape[1]
        rows = [x.unflatten(1, (tp, s // tp)) for x in xs_in]  # (b, tp, s_l, in_i)

        def chunk(lo: int, hi: int) -> torch.Tensor:  # the partial sums the unfused block adds
            ys = [F.linear(r[:, :, lo:hi], w) for r, w in zip(rows, ws, strict=True)]
            return functools.reduce(torch.add, ys)

        return scatter_chunks(chunk, xs[0].shape[0], s // tp, group, chunks)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        xs, weights = saved[:ctx.n], saved[ctx.n:]
        ws = [w.to(x.dtype) for x, w in zip(xs, weights, strict=True)]
        dy = dy.contiguous().to(xs[0].dtype)
        grads_in = [functools.partial(torch.matmul, other=w) for w in ws]  # each dx_i, chunk by chunk
        dxs, dy_full = land_gather(dy, start_gather(dy, ctx.group, ctx.chunks), grads_in)
        dws = [_rows(dy_full).t().matmul(_rows(x)).to(w.dtype) for x, w in zip(xs, weights, strict=True)]
        return None, None, None, *(dx.to(d) for dx, d in zip(dxs, ctx.x_dtypes, strict=True)), *dws


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
        return _GatherLinear.apply(x, self.group, self.chunks, (self.copies,), self.weight)[0]


class SharedInputSlot(nn.Module):
    """A column-parallel weight (out/tp, in) of the fused parallel block (qkv or mlp.fc) whose
    GEMM `SharedGather` already ran: forward passes that output on. It keeps the weight under
    its usual name and tp split, so checkpoints are those of the unfused block."""

    def __init__(self, weight: torch.Tensor, split: TpSplit, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.split = split
        # rows this rank holds a copy of (kv heads fewer than tp): their gradients are summed
        self.copies = split.copies(dist.get_rank(group), dist.get_world_size(group))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y


class SharedGather(nn.Module):
    """x (b, s/tp, in) -> one (b, s, out_i/tp) per slot, behind ONE all-gather of x (MegaScale
    sec. 3.1: the parallel block's attention and MLP read one input). Collective over `group`
    in forward and backward. The slots' weights are its own parameters too (their first names,
    attn.qkv.weight and mlp.fc.weight, stay theirs), so ZeRO waits for them before this runs."""

    def __init__(self, slots: list[SharedInputSlot], group: dist.ProcessGroup, chunks: int = 1) -> None:
        super().__init__()
        for i, slot in enumerate(slots):
            self.register_parameter(f"weight_{i}", slot.weight)
        self.n, self.group, self.chunks = len(slots), group, chunks
        self.copies = tuple(slot.copies for slot in slots)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = [getattr(self, f"weight_{i}") for i in range(self.n)]
        return _GatherLinear.apply(x, self.group, self.chunks, self.copies, *weights)


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


class PartialRowLinear(nn.Module):
    """x (b, s, in/tp) -> this rank's partial sum (b, s, out) of x @ W^T, not yet reduced. In
    the fused parallel block it holds the projection's weight under its usual name and split,
    and `SharedScatter` computes it, added to the other branch's and reduce-scattered once. No
    collective."""

    split = COLUMNS

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (out, in/tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SharedScatter(nn.Module):
    """Row-parallel GEMMs of the fused parallel block, x_i (b, s, in_i/tp) -> (b, s/tp, out):
    this rank's partial sums of attention's and the MLP's projections, added and reduce-scattered
    as ONE collective whose chunks travel while the next chunk's GEMMs run. The projections'
    weights are its own parameters too (their first names, attn.proj.weight and mlp.proj.weight,
    stay theirs), so ZeRO waits for them before this runs. Collective over `group`."""

    def __init__(self, projections: list[PartialRowLinear], group: dist.ProcessGroup, chunks: int = 1) -> None:
        super().__init__()
        for i, proj in enumerate(projections):
            self.register_parameter(f"weight_{i}", proj.weight)
        self.n, self.group, self.chunks = len(projections), group, chunks

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        weights = [getattr(self, f"weight_{i}") for i in range(self.n)]
        return _LinearsScatterSum.apply(self.group, self.chunks, self.n, *xs, *weights)


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
