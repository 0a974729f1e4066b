"""LAMB: layer-wise adaptive moments for large-batch training."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from mshpc.cpu_ranks.eager_optimizer import EagerOptimizer
from mshpc.optim.multi_tensor import closure_loss, init_moments


class Lamb(EagerOptimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2):
    r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w, then w -= lr * (||w|| / ||r||) * r,
    with the trust ratio taken per parameter tensor and 1 when either norm is 0."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"Lamb needs lr, eps, weight_decay >= 0 and betas in [0, 1); got lr={lr}, "
                f"betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's own optimizers' signature
        """Update every parameter that has a gradient; closure, if given, recomputes the loss."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _direction(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance p's moments; return r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w."""
        state = self.state[p]
        init_moments(state, p)  # torch's Adam state layout, so checkpoints treat both alike
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = state["step"].item()
        m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        r = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt_().add_(group["eps"]))
        if group["weight_decay"]:
            r.add_(p, alpha=group["weight_decay"])
        return r

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        r = self._direction(p, group)
        w_norm, r_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(r)
        # torch.where, not `if`, so the ratio stays on the device without a host sync.
        ok = (w_norm > 0) & (r_norm > 0)
        trust = torch.where(ok, w_norm / r_norm, torch.ones_like(w_norm))
        p.add_(r * trust, alpha=-group["lr"])
