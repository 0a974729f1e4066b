"""Expert parallelism's dispatch and combine: each rank's tokens, sorted by expert, go to the ep
rank that holds their experts and come back, by all-to-all with uneven splits (the counts
exchanged first), over the ep group, through comm.py on gloo and NCCL alike.

Overlap (MegaScale-MoE sec. 4; DeepSeek-V3's dual micro-batch overlap): a MoE block's micro-batch
is cut into slices (`overlapped_block`), so that one slice's all-to-alls travel while another's
attention or experts compute; a micro-batch too small to cut has its tokens cut into chunks
inside the layer instead, every chunk's dispatch started at once, the shared experts computing
while they travel, chunk c's experts while chunk c + 1 is in flight. Each exchange is two
autograd nodes, its start and its wait, so backward (which runs nodes in reverse order of
creation) starts each gradient's exchange as soon as it exists and waits for it only where it is
needed: one slice's backward runs while another's gradients travel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mshpc.graph_breaks import eager_method
from mshpc.model.moe import MoE
from mshpc.model.router import Routing
from mshpc.parallel import comm


@dataclass
class _Flight:
    """One token exchange: the rows each way, and its forward and backward operations in flight."""

    send_rows: list[int]  # rows of the forward's input to each ep rank
    recv_rows: list[int]  # rows of the forward's output from each ep rank
    group: dist.ProcessGroup
    work: comm.Pending | None = None
    grad_work: comm.Pending | None = None
    held: list[torch.Tensor] = field(default_factory=list)  # buffers the exchange in flight reads or writes
    grad: torch.Tensor | None = None  # the backward's result: the gradient of the forward's input


class _Start(torch.autograd.Function):
    """Starts the exchange of x's rows; its output is filled once _Wait has waited. Backward:
    waits for the gradient's exchange that _Wait's backward started."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, flight: _Flight) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(sum(flight.recv_rows), x.shape[1])
        flight.work = comm.all_to_all_v(out, x, flight.recv_rows, flight.send_rows, flight.group, async_op=True)
        flight.held = [x, out]
        ctx.flight = flight
        return out

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        flight: _Flight = ctx.flight
        if flight.grad_work is not None:
            flight.grad_work.wait()
        grad, flight.grad, flight.held = flight.grad, None, []
        return grad, None


class _Wait(torch.autograd.Function):
    """Waits for the exchange _Start began; backward starts the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, flight: _Flight) -> torch.Tensor:
        if flight.work is not None:
            flight.work.wait()
        flight.work, flight.held = None, []
        ctx.flight = flight
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        flight: _Flight = ctx.flight
        grad = grad.contiguous()
        flight.grad = grad.new_empty(sum(flight.send_rows), grad.shape[1])
        flight.grad_work = comm.all_to_all_v(flight.grad, grad, flight.send_rows, flight.recv_rows, flight.group,
                                             async_op=True)
        flight.held = [grad]
        return grad, None  # _Start ignores it: its gradient is what the exchange brings


def start(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: dist.ProcessGroup) -> tuple[torch.Tensor, _Flight]:
    """Start exchanging x's rows over `group`: send_rows[j] to ep rank j, recv_rows[i] from rank i.
    Collective over the group; `finish` returns the received rows."""
    flight = _Flight(send_rows, recv_rows, group)
    return _Start.apply(x, flight), flight


def finish(out: torch.Tensor, flight: _Flight) -> torch.Tensor:
    return _Wait.apply(out, flight)


def chunk_positions(experts: torch.Tensor, kept: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For one chunk of tokens: (pos (T, k), counts (E,), rows) of its kept copies in expert
    order (the capacity, decided over the whole micro-batch, already marked what is kept)."""
    flat = torch.where(kept, experts, n_experts).flatten()  # dropped copies sort last
    order = torch.argsort(flat, stable=True)
    rows = int(kept.sum())
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=flat.device)
    pos = torch.where(kept.flatten(), pos, -1)
    counts = flat.new_zeros(n_experts + 1).scatter_add_(0, flat, torch.ones_like(flat))[:n_experts]
    return pos.view_as(experts), counts, rows


class AllToAllDispatch:
    """A MoE layer's dispatch (model/moe.py `Dispatch`) under expert parallelism: this rank holds
    experts [rank * L, (rank + 1) * L) of E, L = E / ep. `chunks`: token chunks whose exchanges
    overlap each other's experts (1 without overlap: each exchange waited on at once). Collective
    over the ep group (every ep rank runs every MoE layer of every micro-batch, in one order)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int, chunks: int, overlap: bool) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.local = n_experts // self.ep
        self.n_experts = n_experts
        self.chunks = chunks if overlap else 1
        self.overlap = overlap

    # the split sizes are read on the host (their counts exchanged first): under train.compile the
    # dispatch runs between the block's graphs, as tp's collectives do
    @eager_method
    def start(self, x: torch.Tensor, routing: Routing, layer: MoE) -> _Exchange:
        """Permute each chunk's tokens into expert order, exchange the counts (one small blocking
        all-to-all), and start every chunk's dispatch."""
        tokens = x.shape[0]
        bounds = [tokens * c // self.chunks for c in range(self.chunks + 1)]
        parts = [self._positions(routing, lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
        # (chunk, ep rank, local expert) counts this rank sends; received: (ep rank, chunk, local expert)
        sent = torch.stack([counts for _, counts, _ in parts]).view(self.chunks, self.ep, self.local)
        received = torch.empty(self.ep, self.chunks, self.local, dtype=sent.dtype, device=sent.device)
        comm.all_to_all(received, sent.transpose(0, 1).contiguous(), self.group)
        from_ranks = received.transpose(0, 1).cpu()  # (chunk, ep rank, local expert): one host sync
        flight = _Exchange(self, x, routing, layer, bounds, parts, from_ranks)
        for c, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
            pos, counts, rows = parts[c]
            xp = layer.kernels.moe_permute(x[lo:hi], pos, rows)  # (rows, d) by global expert
            send_rows = counts.view(self.ep, self.local).sum(1).tolist()
            flight.dispatches.append(self._exchange(xp, send_rows, from_ranks[c].sum(1).tolist()))
        return flight

    def _exchange(self, rows: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> tuple[torch.Tensor, _Flight]:
        out, flight = start(rows, send_rows, recv_rows, self.group)
        return (finish(out, flight), flight) if not self.overlap else (out, flight)

    def _positions(self, routing: Routing, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.chunks == 1:
            return routing.pos, routing.counts, routing.rows
        pos = routing.pos[lo:hi]
        return chunk_positions(routing.experts[lo:hi], pos >= 0, self.n_experts)

    def experts(self, got: torch.Tensor, counts: torch.Tensor, layer: MoE) -> torch.Tensor:
        """This rank's experts over the rows received, counts (ep rank, local expert) of them in
        the order [rank 0: expert 0.., rank 1: expert 0..]: sorted by local expert, computed,
        put back in the order received."""
        local_of_row = torch.arange(self.local).repeat(self.ep).repeat_interleave(counts.flatten())
        order = torch.argsort(local_of_row, stable=True).to(got.device)  # received row of each sorted row
        into = torch.empty_like(order)
        into[order] = torch.arange(order.numel(), device=got.device)  # sorted place of each received row
        rows = got.shape[0]
        sorted_rows = layer.kernels.moe_permute(got, into.view(-1, 1), rows)
        y = layer.experts(sorted_rows, counts.sum(0).to(got.device))
        return layer.kernels.moe_permute(y, order.view(-1, 1), rows)


class _Exchange:
    """One MoE layer's tokens under way (model/moe.py `InFlight`): the chunks' dispatches started;
    `compute` runs the shared experts (the dispatches are still travelling), then each chunk's
    experts once it has arrived and starts its combine; `finish` waits for the combines and sums
    each token's expert outputs."""

    def __init__(self, dispatch: AllToAllDispatch, x: torch.Tensor, routing: Routing, layer: MoE, bounds: list[int],
                 parts: list[tuple[torch.Tensor, torch.Tensor, int]], from_ranks: torch.Tensor) -> None:
        self.dispatch, self.x, self.routing, self.layer = dispatch, x, routing, layer
        self.bounds, self.parts, self.from_ranks = bounds, parts, from_ranks
        self.dispatches: list[tuple[torch.Tensor, _Flight]] = []
        self.combines: list[tuple[torch.Tensor, _Flight]] = []
        self.shared: torch.Tensor | None = None

    @eager_method
    def compute(self) -> None:
        if self.combines:
            return
        d, layer = self.dispatch, self.layer
        if layer.shared is not None:
            self.shared = layer.shared_output(self.x)
        for c, (got, flight) in enumerate(self.dispatches):
            received = got if not d.overlap else finish(got, flight)
            y = d.experts(received, self.from_ranks[c], layer)
            self.combines.append(d._exchange(y, flight.recv_rows, flight.send_rows))

    @eager_method
    def finish(self) -> torch.Tensor:
        self.compute()
        outs = []
        for c, (back, flight) in enumerate(self.combines):
            y = back if not self.dispatch.overlap else finish(back, flight)
            lo, hi = self.bounds[c], self.bounds[c + 1]
            outs.append(self.layer.kernels.moe_unpermute(y, self.parts[c][0], self.routing.weights[lo:hi]))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out if self.shared is None else out + self.shared


def overlapped_block(block: Any, slices: int) -> Callable[..., torch.Tensor]:  # Any: a Block, its parts swapped
    """A MoE block's forward cut into `slices` slices of its micro-batch (DeepSeek-V3's dual
    micro-batch overlap; MegaScale-MoE sec. 4): slice i + 1's attention runs while slice i's
    tokens travel to their experts, slice i + 1's dispatch while slice i's experts compute, slice
    i's combine while slice i + 1's experts compute; backward, in reverse order of creation,
    interleaves alike. A micro-batch of fewer sequences than slices (an evaluation's last), or
    decoding, runs the block whole."""
    whole = block.forward

    def forward(x: torch.Tensor, doc_mask: torch.Tensor | None = None, cache: Any = None) -> torch.Tensor:
        if cache is not None or x.shape[0] < slices:
            return whole(x, doc_mask, cache)
        masks = doc_mask.chunk(slices) if doc_mask is not None else [None] * slices
        started = []
        for xi, mask in zip(x.chunk(slices), masks, strict=True):
            h, xi = block.attention_half(xi, mask)
            started.append((xi, block.mlp.start(h)))
        for _, s in started:
            s.flight.compute()
        outs = block.mlp.finish([s for _, s in started])
        return torch.cat([xi + out for (xi, _), out in zip(started, outs, strict=True)])

    return forward
