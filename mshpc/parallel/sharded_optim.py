"""Optimizers over ZeRO shards: each optimized tensor is one rank's piece (a flat range) of a
model parameter, and its state exists only for that piece.

AdamW is elementwise, so torch's AdamW over the pieces is the unsharded AdamW. LAMB's trust
ratio needs the norms of whole parameters; `ShardedLamb` sums the pieces' squared norms over
the dp group with one all-reduce per step, and under tensor parallelism over the tp group too
(the norm of a tp-split parameter is that of the unsplit one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mshpc.config import OptimConfig
from mshpc.errors import ConfigError
from mshpc.optim.lamb import Lamb
from mshpc.parallel import comm

# The per-piece state tensors both optimizers keep (besides the step counter).
STATE_KEYS = ("exp_avg", "exp_avg_sq")


class ShardedLamb(Lamb):
    """LAMB (You et al. 2019, Algorithm 2) over shard pieces: the same update as
    mshpc.optim.lamb.Lamb, with ||w|| and ||r|| of each whole parameter. Each param group
    carries "owner": for each piece, the index of the parameter it belongs to (< n_params).
    step() is collective over `group` (the dp group) and `tp_group`; parameters in `tp_whole`
    (indices) are held whole by every tp rank and count once."""

    def __init__(
        self, groups: list[dict[str, Any]], n_params: int, group: dist.ProcessGroup | None,
        lr: float, betas: tuple[float, float], eps: float,
        tp_group: dist.ProcessGroup | None = None, tp_whole: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(groups, lr=lr, betas=betas, eps=eps)
        self.n_params = n_params
        self.dp_group = group
        self.tp_group, self.tp_whole = tp_group, sorted(tp_whole)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore
        """Update every piece; every dp rank must call it (one all-reduce of 2 * n_params)."""
        assert closure is None, "ShardedLamb.step takes no closure"
        pieces, updates, owners = [], [], []
        for group in self.param_groups:
            for p, owner in zip(group["params"], group["owner"]):
                if p.grad is not None:
                    pieces.append((p, group))
                    updates.append(self._direction(p, group))
                    owners.append(owner)
        device = pieces[0][0].device if pieces else torch.device("cpu")
        # (2, n_params): squared norms of w and r per whole parameter, summed over ranks
        norms_sq = torch.zeros(2, self.n_params, device=device)
        if pieces:
            index = torch.tensor(owners, device=device)
            norms_sq[0].index_add_(0, index, torch.stack([p.square().sum() for p, _ in pieces]))
            norms_sq[1].index_add_(0, index, torch.stack([r.square().sum() for r in updates]))
        comm.all_reduce(norms_sq, group=self.dp_group)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            if dist.get_rank(self.tp_group) > 0:
                norms_sq[:, self.tp_whole] = 0.0  # tp rank 0's copy counts
            comm.all_reduce(norms_sq, group=self.tp_group)
        w_norm, r_norm = norms_sq.sqrt()
        ok = (w_norm > 0) & (r_norm > 0)
        trust = torch.where(ok, w_norm / r_norm, torch.ones_like(w_norm))  # (n_params,)
        for (p, group), r, owner in zip(pieces, updates, owners):
            p.add_(r * trust[owner], alpha=-group["lr"])
        return None


def build_shard_optimizer(
    groups: list[dict[str, Any]], n_params: int, cfg: OptimConfig, group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None = None, tp_whole: frozenset[int] = frozenset(),
) -> torch.optim.Optimizer:
    """AdamW or ShardedLamb by cfg.name over shard-piece groups (each with "params",
    "weight_decay" and "owner"), with every piece's state created now (zeros, step 0), so the
    state is complete, and measurable, before the first step. tp_group, tp_whole: see
    ShardedLamb."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adamw":
        # "owner" rides along in the groups unused: AdamW needs no whole-parameter norms.
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            groups, lr=cfg.lr, betas=betas, eps=cfg.eps, foreach=True)
    elif cfg.name == "lamb":
        optimizer = ShardedLamb(groups, n_params, group, lr=cfg.lr, betas=betas, eps=cfg.eps,
                                tp_group=tp_group, tp_whole=tp_whole)
    else:
        raise ConfigError(f"optim.name={cfg.name!r} is not an optimizer (choose 'adamw' or 'lamb')")
    for g in optimizer.param_groups:
        for p in g["params"]:
            # A CPU float step, as torch's AdamW makes it when not capturable.
            optimizer.state[p] = {"step": torch.tensor(0.0), **{k: torch.zeros_like(p) for k in STATE_KEYS}}
    return optimizer
