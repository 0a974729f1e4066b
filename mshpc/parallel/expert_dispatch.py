"""Expert parallelism's dispatch and combine: each rank's tokens, sorted by expert, go to the ep
rank that holds their experts and come back, by all-to-all with uneven splits (the counts
exchanged first), over the ep group, through comm.py on gloo and NCCL alike.

Overlap (MegaScale-MoE sec. 4; DeepSeek-V3's dual micro-batch overlap, within one micro-batch
here): the tokens are cut into `chunks`; every chunk's dispatch is started at once, the shared
experts compute while they travel, then chunk c's experts compute while chunk c + 1 is still in
flight and chunk c's combine travels during chunk c + 1's experts. Each exchange is two autograd
nodes, its start and its wait, so backward (which runs nodes in reverse order of creation) starts
each gradient's exchange as soon as it exists and waits for it only where it is needed: the
experts' backward of one chunk runs while another's gradients travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

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
    experts [rank * L, (rank + 1) * L) of E, L = E / ep. Collective over the ep group (every ep
    rank runs every MoE layer of every micro-batch, in the same order)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int, chunks: int, overlap: bool) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.local = n_experts // self.ep
        self.n_experts = n_experts
        self.chunks = chunks if overlap else 1
        self.overlap = overlap

    # the split sizes are read on the host (their counts exchanged first): under train.compile the
    # dispatch runs between the block's graphs, as tp's collectives do
    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, routing: Routing, layer: MoE) -> torch.Tensor:
        tokens = x.shape[0]
        bounds = [tokens * c // self.chunks for c in range(self.chunks + 1)]
        parts = [self._positions(routing, lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
        # (chunk, ep rank, local expert) counts this rank sends; received: (ep rank, chunk, local expert)
        sent = torch.stack([counts for _, counts, _ in parts]).view(self.chunks, self.ep, self.local)
        received = torch.empty(self.ep, self.chunks, self.local, dtype=sent.dtype, device=sent.device)
        comm.all_to_all(received, sent.transpose(0, 1).contiguous(), self.group)
        from_ranks = received.transpose(0, 1).cpu()  # (chunk, ep rank, local expert): one host sync
        flights = []
        for c, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
            pos, counts, rows = parts[c]
            xp = layer.kernels.moe_permute(x[lo:hi], pos, rows)  # (rows, d) by global expert
            send_rows = counts.view(self.ep, self.local).sum(1).tolist()
            recv_rows = from_ranks[c].sum(1).tolist()
            flights.append(start(xp, send_rows, recv_rows, self.group))
            if not self.overlap:  # each exchange waited on before anything else runs
                flights[-1] = (finish(*flights[-1]), flights[-1][1])
        shared = layer.shared_output(x) if layer.shared is not None else None  # while the dispatches travel
        combines = []
        for c, (received_rows, flight) in enumerate(flights):
            got = received_rows if not self.overlap else finish(received_rows, flight)
            y = self._experts(got, from_ranks[c], layer)
            combines.append(start(y, flight.recv_rows, flight.send_rows, self.group))
            if not self.overlap:
                combines[-1] = (finish(*combines[-1]), combines[-1][1])
        outs = []
        for c, (back, flight) in enumerate(combines):
            y = back if not self.overlap else finish(back, flight)
            pos, _, _ = parts[c]
            outs.append(layer.kernels.moe_unpermute(y, pos, routing.weights[bounds[c]:bounds[c + 1]]))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out if shared is None else out + shared

    def _positions(self, routing: Routing, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.chunks == 1:
            return routing.pos, routing.counts, routing.rows
        pos = routing.pos[lo:hi]
        return chunk_positions(routing.experts[lo:hi], pos >= 0, self.n_experts)

    def _experts(self, got: torch.Tensor, counts: torch.Tensor, layer: MoE) -> torch.Tensor:
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
