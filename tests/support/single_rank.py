"""The reference the parallel engines are tested against: plain single-rank training."""

from collections.abc import Callable

import torch

from mshpc.config import ModelConfig, OptimConfig
from mshpc.model.gpt import GPT, loss_fn
from mshpc.optim.optimizer import build_optimizer


def train_single_rank(model_cfg: ModelConfig, optim_cfg: OptimConfig, batch: Callable[[int], torch.Tensor],
                      steps: int) -> tuple[GPT, torch.optim.Optimizer, list[float], list[float]]:
    """`steps` steps on the whole global batch `batch(step)` (b, s + 1) from seed 0, with torch's
    clipping to optim_cfg.grad_clip and the unsharded optimizer. Returns the model, optimizer,
    losses and grad norms before clipping."""
    torch.manual_seed(0)
    model = GPT(model_cfg)
    optimizer = build_optimizer(model, optim_cfg)
    losses, norms = [], []
    for step in range(steps):
        b = batch(step)
        loss = loss_fn(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, optimizer, losses, norms
