"""Optimizers over ZeRO shards: each optimized tensor is one rank's piece (a flat range) of a
model parameter, and its state exists only for that piece.

AdamW is elementwise, so torch's AdamW over the pieces is the unsharded AdamW. LAMB's trust
ratio needs the norms of whole parameters; `ShardedLamb` sums the pieces' squared norms over
the dp group with one all-reduce per step, and under tensor parallelism over the tp group too
(the norm of a tp-split parameter is that of the unsplit one); a parameter of a ZeRO shard domain
(an expert: its dp peers hold other experts under the same name) sums over its domain's group
instead of the dp group. With the fused kernels both
update all of a rank's pieces in one multi-tensor launch (LAMB: one before the all-reduce, one
after).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from mshpc.config import OptimConfig
from mshpc.errors import ConfigError
from mshpc.kernels.ops import mshpc_ops
from mshpc.optim.lamb import Lamb
from mshpc.optim.multi_tensor import FusedAdamW, advance_steps, init_moments
from mshpc.parallel import comm

# The per-piece state tensors both optimizers keep (besides the step counter).
STATE_KEYS = ("exp_avg", "exp_avg_sq")
Piece = tuple[torch.Tensor, dict[str, Any], int]  # a shard piece, its group, its parameter's index
NormDomains = tuple[tuple[dist.ProcessGroup, frozenset[int]], ...]  # a shard domain's group and parameters


class ShardedLamb(Lamb):
    """LAMB (You et al. 2019, Algorithm 2) over shard pieces: the same update as
    mshpc.optim.lamb.Lamb, with ||w|| and ||r|| of each whole parameter. Each param group
    carries "owner": for each piece, the index of the parameter it belongs to (< n_params).
    step() is collective over `group` (the dp group), `tp_group` and each domain's group;
    parameters in `tp_whole` (indices) are held whole by every tp rank and count once; those of
    `domains` ((group, indices) each) are summed over their own group, not the dp group."""

    def __init__(
        self, groups: list[dict[str, Any]], n_params: int, group: dist.ProcessGroup | None,
        lr: float, betas: tuple[float, float], eps: float,
        tp_group: dist.ProcessGroup | None = None, tp_whole: frozenset[int] = frozenset(),
        domains: NormDomains = (),
    ) -> None:
        super().__init__(groups, lr=lr, betas=betas, eps=eps)
        self.n_params = n_params
        self.dp_group = group
        self.tp_group, self.tp_whole = tp_group, sorted(tp_whole)
        self.domains = tuple((g, sorted(indices)) for g, indices in domains)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's own optimizers' signature
        """Update every piece; every dp rank must call it (one all-reduce of 2 * n_params)."""
        assert closure is None, "ShardedLamb.step takes no closure"
        pieces = [(p, group, owner) for group in self.param_groups
                  for p, owner in zip(group["params"], group["owner"], strict=True) if p.grad is not None]
        device = pieces[0][0].device if pieces else torch.device("cpu")
        # (2, n_params): squared norms of w and r per whole parameter, summed over ranks
        norms_sq = torch.zeros(2, self.n_params, device=device)
        updates: list[torch.Tensor] = []
        if pieces:
            updates, piece_norms_sq = self._directions(pieces)
            norms_sq.index_add_(1, torch.tensor([owner for *_, owner in pieces], device=device), piece_norms_sq)
        self._sum_over_dp(norms_sq)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            if dist.get_rank(self.tp_group) > 0:
                norms_sq[:, self.tp_whole] = 0.0  # tp rank 0's copy counts
            comm.all_reduce(norms_sq, group=self.tp_group)
        w_norm, r_norm = norms_sq.sqrt()
        ok = (w_norm > 0) & (r_norm > 0)
        trust = torch.where(ok, w_norm / r_norm, torch.ones_like(w_norm))  # (n_params,)
        self._apply(pieces, updates, trust)
        return None

    def _sum_over_dp(self, norms_sq: torch.Tensor) -> None:
        """Sum the pieces' squared norms over the ranks that hold pieces of the same parameter."""
        own = [(g, indices, norms_sq[:, indices].clone()) for g, indices in self.domains]
        for _, indices, _ in own:
            norms_sq[:, indices] = 0.0  # other experts under the same name on the dp peers
        comm.all_reduce(norms_sq, group=self.dp_group)
        for g, indices, part in own:
            comm.all_reduce(part, group=g)
            norms_sq[:, indices] = part

    def _directions(self, pieces: list[Piece]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each piece's direction r, and the squared norms of the pieces and of r, (2, pieces)."""
        updates = [self._direction(p, group) for p, group, _ in pieces]
        norms_sq = torch.stack([torch.stack([p.square().sum() for p, _, _ in pieces]),
                                torch.stack([r.square().sum() for r in updates])])
        return updates, norms_sq

    def _apply(self, pieces: list[Piece], updates: list[torch.Tensor], trust: torch.Tensor) -> None:
        for (p, group, owner), r in zip(pieces, updates, strict=True):
            p.add_(r * trust[owner], alpha=-group["lr"])


class FusedShardedLamb(ShardedLamb):
    """ShardedLamb with its two local halves as multi-tensor kernels (csrc/): one launch advances
    every piece's moments and writes its direction into the piece's gradient, with both squared
    norms; after the all-reduce one launch applies the trust-scaled directions. Betas and eps are
    the optimizer's; groups may set lr and weight_decay."""

    def _directions(self, pieces: list[Piece]) -> tuple[list[torch.Tensor], torch.Tensor]:
        params = [p for p, _, _ in pieces]
        for p in params:
            init_moments(self.state[p], p)
        states = [self.state[p] for p in params]
        steps = advance_steps(states)
        assert len(set(steps)) == 1, "ZeRO pieces always have gradients, so they step together"
        beta1, beta2 = self.defaults["betas"]
        grads = [cast(torch.Tensor, p.grad) for p in params]  # step() passes only pieces with one
        norms_sq = mshpc_ops.multi_tensor_lamb_direction(
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [float(group["weight_decay"]) for _, group, _ in pieces], beta1, beta2, self.defaults["eps"], steps[0])
        return grads, norms_sq.T  # the directions now live in the gradients

    def _apply(self, pieces: list[Piece], updates: list[torch.Tensor], trust: torch.Tensor) -> None:
        if not pieces:
            return
        device = trust.device
        owners = torch.tensor([owner for *_, owner in pieces], device=device)
        lrs = torch.tensor([float(group["lr"]) for _, group, _ in pieces], device=device)
        mshpc_ops.multi_tensor_lamb_apply([p for p, _, _ in pieces], updates, trust[owners] * lrs)


def build_shard_optimizer(
    groups: list[dict[str, Any]], n_params: int, cfg: OptimConfig, group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None = None, tp_whole: frozenset[int] = frozenset(), fused: bool = False,
    domains: NormDomains = (),
) -> torch.optim.Optimizer:
    """AdamW or ShardedLamb by cfg.name over shard-piece groups (each with "params",
    "weight_decay" and "owner"), their multi-tensor kernel versions when `fused` (the kernels
    must be loaded: mshpc.kernels.dispatch), with every piece's state created now (zeros, step
    0), so the state is complete, and measurable, before the first step. tp_group, tp_whole,
    domains: see ShardedLamb."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adamw":
        # "owner" rides along in the groups unused: AdamW needs no whole-parameter norms.
        optimizer: torch.optim.Optimizer = (
            FusedAdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps) if fused
            else torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, foreach=True))
    elif cfg.name == "lamb":
        lamb = FusedShardedLamb if fused else ShardedLamb
        optimizer = lamb(groups, n_params, group, lr=cfg.lr, betas=betas, eps=cfg.eps,
                         tp_group=tp_group, tp_whole=tp_whole, domains=domains)
    else:
        raise ConfigError(f"optim.name={cfg.name!r} is not an optimizer (choose 'adamw' or 'lamb')")
    for g in optimizer.param_groups:
        for p in g["params"]:
            init_moments(optimizer.state[p], p)
    return optimizer
