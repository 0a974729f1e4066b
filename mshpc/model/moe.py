"""A mixture of experts in place of a block's MLP (Shazeer et al. 2017; Mixtral, Qwen-MoE,
DeepSeek-V3): a router sends each token to k of E SwiGLU experts, the tokens are sorted by
expert (one fused permute), the experts run as one grouped GEMM, and each token's outputs are
summed back with the router's weights (one fused unpermute); shared experts, if any, see every
token. Plain modules: expert parallelism replaces `dispatch` and `shards` from outside
(mshpc/parallel/expert_parallel.py), as tensor parallelism sets attention's head counts.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mshpc.config import ModelConfig
from mshpc.graph_breaks import eager_function, eager_method
from mshpc.kernels.dispatch import Kernels, select_kernels
from mshpc.model.router import Router, Routing, aux_loss, z_loss

log = logging.getLogger(__name__)

# What a layer records per step (MoE.stats, beside its E token counts): copies dropped by the
# capacity, the auxiliary and z losses (before their coefficients), micro-batches seen.
STATS = ("dropped", "aux_loss", "z_loss", "micro_batches")


def recomputing() -> bool:
    """Whether this forward is activation checkpointing's recomputation: non-reentrant
    checkpointing reruns a block inside backward's graph task, where mshpc runs no other forward
    (torch.utils.checkpoint asks torch the same question). A marker that needs no checkpoint
    context_fn, which torch.compile accepts only when it makes TorchDispatchModes."""
    return torch._C._current_graph_task_id() != -1


@functools.cache
def grouped_mm_works(device_type: str) -> bool:
    """Whether torch._grouped_mm runs on this kind of device in fp32 and bf16 (both do on CPU in
    torch 2.13; CUDA builds need sm_90 for some): tried once on a tiny case and logged."""
    if not hasattr(torch, "_grouped_mm"):
        log.info("moe experts: this torch has no _grouped_mm: a loop over the experts")
        return False
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.zeros(2, 8, device=device_type, dtype=dtype)
            w = torch.zeros(2, 8, 8, device=device_type, dtype=dtype)
            torch._grouped_mm(x, w, offs=torch.tensor([1, 2], device=device_type, dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as exc:
        log.info("moe experts: torch._grouped_mm does not run on %s (%s): a loop over the experts",
                 device_type, str(exc).splitlines()[0][:120])
        return False
    log.info("moe experts: one torch._grouped_mm for all experts on %s", device_type)
    return True


class GroupedExperts(nn.Module):
    """E SwiGLU experts as two stacked weights: fc (E, 2 * ffn, d) holding each expert's rows
    [gate; up], proj (E, d, ffn), the layout of transformers' MixtralExperts. forward takes the
    tokens in expert order and each expert's count."""

    def __init__(self, n_experts: int, d_model: int, ffn: int, impl: str, kernels: Kernels) -> None:
        super().__init__()
        self.impl = impl
        self.kernels = kernels
        self.fc = nn.Parameter(torch.empty(n_experts, 2 * ffn, d_model))
        self.proj = nn.Parameter(torch.empty(n_experts, d_model, ffn))
        # which of the layer's experts these are: all of them, or an ep rank's share (expert_parallel.py)
        self.first_expert, self.total_experts = 0, n_experts

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, d) sorted by expert, counts (E,) summing to M -> (M, d)."""
        fc: torch.Tensor = self.fc
        proj: torch.Tensor = self.proj
        if torch.is_autocast_enabled(x.device.type):  # _grouped_mm has no autocast rule: cast as F.linear would
            dtype = torch.get_autocast_dtype(x.device.type)
            x, fc, proj = x.to(dtype), fc.to(dtype), proj.to(dtype)
        if not self._grouped(x):
            return _expert_loop(x, counts, fc, proj, self.kernels)
        # torch.compile traces _grouped_mm in bf16 only (its fake kernel asks for CUDA's dtype):
        # other dtypes run it between the compiled graphs
        run = _grouped_gemms if x.dtype == torch.bfloat16 else _grouped_gemms_eager
        return run(x, counts, fc, proj, self.kernels)

    def resolve_impl(self, device_type: str) -> None:
        """Settle moe.experts_impl=auto for this kind of device: before torch.compile traces the
        layer (parallel/apply.py), or at the first eager forward."""
        if self.impl == "auto":
            self.impl = "grouped_mm" if grouped_mm_works(device_type) else "loop"

    def _grouped(self, x: torch.Tensor) -> bool:
        self.resolve_impl(x.device.type)
        return self.impl == "grouped_mm" and x.dtype != torch.float64  # _grouped_mm has no float64


def _grouped_gemms(x: torch.Tensor, counts: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor,
                   kernels: Kernels) -> torch.Tensor:
    """Every expert's SwiGLU in two grouped GEMMs over the rows sorted by expert."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x, fc.transpose(-2, -1), offs=offs)  # (M, 2 * ffn) [gate | up]
    return torch._grouped_mm(kernels.swiglu(h), proj.transpose(-2, -1), offs=offs)


@eager_function
def _grouped_gemms_eager(x: torch.Tensor, counts: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor,
                         kernels: Kernels) -> torch.Tensor:
    """_grouped_gemms between the compiled graphs."""
    return _grouped_gemms(x, counts, fc, proj, kernels)


@eager_function  # split sizes read on the host: a graph break either way
def _expert_loop(x: torch.Tensor, counts: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor,
                 kernels: Kernels) -> torch.Tensor:
    """Every expert's SwiGLU, one after the other (a host sync: the split sizes)."""
    parts = x.split(counts.tolist())
    outs = [F.linear(kernels.swiglu(F.linear(part, fc[e])), proj[e]) for e, part in enumerate(parts)]
    return torch.cat(outs) if outs else x.new_zeros(0, proj.shape[1])


class TokenShards:
    """The ranks whose tokens one router's load statistics sum over: this rank alone here;
    under tensor parallelism its tp group, whose ranks hold one micro-batch's sequence shards
    (parallel/expert_parallel.py). `size`: the shards; `sum`: a sum over them, in place."""

    size = 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


class InFlight(Protocol):
    """Routed tokens on their way: `compute` runs this rank's experts on what has arrived (and
    the shared experts), `finish` returns the layer's output (T, d), computing first if needed."""

    def compute(self) -> None: ...

    def finish(self) -> torch.Tensor: ...


class Dispatch(Protocol):
    """How the routed tokens reach their experts and come back (local, or all-to-all over ep):
    `start` sends them on their way."""

    def start(self, x: torch.Tensor, routing: Routing, layer: MoE) -> InFlight: ...


class Computed:
    """An InFlight whose output is there already."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def compute(self) -> None:
        pass

    def finish(self) -> torch.Tensor:
        return self.out


class LocalDispatch:
    """Every expert on this rank: permute, the experts, unpermute, plus the shared experts."""

    def start(self, x: torch.Tensor, routing: Routing, layer: MoE) -> InFlight:
        xp = layer.kernels.moe_permute(x, routing.pos, routing.rows)  # (rows, d) in expert order
        out = layer.kernels.moe_unpermute(layer.experts(xp, routing.counts), routing.pos, routing.weights)
        return Computed(out if layer.shared is None else out + layer.shared_output(x))


class Started:
    """A layer's forward between MoE.start and MoE.finish."""

    def __init__(self, flight: InFlight, routing: Routing, shape: torch.Size) -> None:
        self.flight, self.routing, self.shape = flight, routing, shape


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the layer's output whose backward also starts the auxiliary losses' backward
    with gradient `scale` (Megatron's MoEAuxLossAutoScaler): the losses join training without
    passing through the model's return value, so the loss function and the pipeline stay as
    they are. `scale` is 1 / the micro-batches per step, as the language-model loss gets."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


class MoE(nn.Module):
    """The layer: router, E routed experts, optional shared experts (one SwiGLU MLP of
    n_shared * expert_ffn, gated by sigmoid(x w) with moe.shared_expert_gate). `shared` is that
    MLP, built by the caller (model/gpt.py's MLP). forward maps (b, s, d) to (b, s, d) and adds
    the auxiliary and z losses, times their coefficients, to the gradient of what it returns."""

    stats: torch.Tensor

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.moe = moe = cfg.moe
        self.kernels = select_kernels(cfg.fused_kernels)
        self.router = Router(cfg.d_model, moe)
        self.experts = GroupedExperts(moe.n_experts, cfg.d_model, cfg.expert_ffn, moe.experts_impl, self.kernels)
        self.shared = shared
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if moe.shared_expert_gate else None
        self.dispatch: Dispatch = LocalDispatch()
        self.shards = TokenShards()
        self.loss_scale = 1.0  # 1 / micro-batches per step (parallel/apply.py)
        # per step: tokens routed to each expert, then STATS; summed over micro-batches (expert_load.py reads and clears it)
        self.register_buffer("stats", torch.zeros(moe.n_experts + len(STATS), dtype=torch.float64), persistent=False)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts of tokens x (T, d)."""
        assert self.shared is not None
        out = self.shared(x)
        return out if self.shared_gate is None else out * torch.sigmoid(self.shared_gate(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish([self.start(x)])[0]

    def start(self, x: torch.Tensor) -> Started:
        """Route x (..., d) and send its tokens to their experts; `finish` completes the layer
        (in between, a caller may compute something else while they travel)."""
        tokens = x.reshape(-1, x.shape[-1])  # (T, d)
        routing = self.router(tokens)
        return Started(self.dispatch.start(tokens, routing, self), routing, x.shape)

    def finish(self, started: list[Started]) -> list[torch.Tensor]:
        """The outputs of slices of one micro-batch `start`ed one after the other; the router's
        losses are the whole micro-batch's (a slice's share of them uses every slice's counts)."""
        outs = [s.flight.finish() for s in started]
        if torch.is_grad_enabled():  # recomputation too: it must save what the forward saved
            outs[-1] = self._add_losses(outs[-1], [s.routing for s in started])
        return [out.view(s.shape) for out, s in zip(outs, started, strict=True)]

    def _add_losses(self, out: torch.Tensor, routings: list[Routing]) -> torch.Tensor:
        """Record the step's statistics and hook the weighted losses onto `out`'s gradient."""
        routed = self.shards.sum(torch.stack([r.routed for r in routings]).sum(0))  # every shard's tokens
        total = sum(r.pos.shape[0] for r in routings) * self.shards.size
        moe = self.moe
        aux = sum((aux_loss(r.scores, routed, total, moe) for r in routings), torch.zeros((), device=out.device))
        z = sum((z_loss(r.logits, total) for r in routings), torch.zeros((), device=out.device))
        dropped = sum((r.dropped for r in routings), torch.zeros((), dtype=torch.long, device=out.device))
        self._record(torch.stack([r.routed for r in routings]).sum(0), dropped, aux, z)
        loss = moe.aux_loss_coef * aux + moe.z_loss_coef * z
        if moe.aux_loss_coef == 0 and moe.z_loss_coef == 0:
            return out
        return _AuxLossGrad.apply(out, loss, self.loss_scale)

    # between compiled graphs: a side effect that a recomputation must skip, decided when it runs
    @eager_method
    @torch.no_grad()
    def _record(self, routed: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor, z: torch.Tensor) -> None:
        """Add this micro-batch to the step's statistics, each a share that sums over the world to
        the step's total (the micro-batch count is split over its token shards); a recomputed
        forward adds nothing."""
        if recomputing():
            return
        e = self.moe.n_experts
        self.stats[:e] += routed
        one = torch.ones((), dtype=torch.float64, device=z.device)
        self.stats[e:] += torch.stack([dropped.double(), aux.double(), z.double(), one / self.shards.size])
