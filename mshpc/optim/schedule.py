"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch

from mshpc.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (counted from 0). Warmup: step s < W gives
    lr * (s + 1) / W, so step 0 gets lr / W and step W - 1 the peak lr; then half-cosine decay
    (Loshchilov & Hutter 2017, SGDR eq. 5) from the peak to min_lr at total_steps and after."""
    peak_step = max(cfg.warmup_steps - 1, 0)
    if step < peak_step:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min((step - peak_step) / max(total_steps - peak_step, 1), 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that sets each group's lr to `lr_at(step)`, for groups whose initial lr is
    cfg.lr (as `build_optimizer` makes them); call its step() after each optimizer step."""

    def factor(step: int) -> float:
        # A plain function, which LambdaLR leaves out of its state_dict: nothing to pickle.
        return lr_at(step, cfg, total_steps) / cfg.lr if cfg.lr > 0 else 0.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
