"""AdamW with one multi-tensor kernel launch per step (mshpc::multi_tensor_adamw, csrc/)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from mshpc.cpu_ranks.eager_optimizer import EagerOptimizer
from mshpc.kernels.ops import mshpc_ops


def init_moments(state: dict[str, Any], p: torch.Tensor) -> None:
    """A tensor's Adam/LAMB state as torch's AdamW makes it: a CPU float step and two moments."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """What torch's optimizers' step(closure) does first: the loss `closure` recomputes, with
    gradients on (step runs under no_grad); None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def advance_steps(states: list[dict[str, Any]]) -> list[int]:
    """Add one to every tensor's step and return the new counts."""
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1.0)
    return [int(t.item()) for t in steps]  # CPU scalars: no device sync


class FusedAdamW(EagerOptimizer):
    """torch.optim.AdamW's update (decoupled weight decay, Loshchilov & Hutter 2019) on fp32
    tensors, every tensor of every group in one kernel launch. Its state is torch's (step,
    exp_avg, exp_avg_sq), so checkpoints move between the two; groups may set lr and
    weight_decay, while betas and eps are the optimizer's."""

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's own optimizers' signature
        """Update every tensor that has a gradient; closure, if given, recomputes the loss."""
        loss = closure_loss(closure)
        tensors = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not tensors:
            return loss
        for p, _ in tensors:
            init_moments(self.state[p], p)
        by_step: dict[int, list[tuple[torch.Tensor, dict[str, Any]]]] = {}
        for (p, group), step in zip(tensors, advance_steps([self.state[p] for p, _ in tensors]), strict=True):
            by_step.setdefault(step, []).append((p, group))
        for step, batch in by_step.items():  # one launch: tensors only differ in step when one sat out
            self._launch(batch, step)
        return loss

    def _launch(self, tensors: list[tuple[torch.Tensor, dict[str, Any]]], step: int) -> None:
        states = [self.state[p] for p, _ in tensors]
        beta1, beta2 = self.defaults["betas"]
        mshpc_ops.multi_tensor_adamw(
            [p for p, _ in tensors], [p.grad for p, _ in tensors], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [float(g["lr"]) for _, g in tensors],
            [float(g["weight_decay"]) for _, g in tensors], beta1, beta2, self.defaults["eps"], step)
