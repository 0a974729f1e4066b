"""Learning-rate schedules: linear warmup, then cosine decay to a floor, warmup-stable-decay, or
a constant rate (optim.schedule)."""

from __future__ import annotations

import math

import torch

from mshpc.config import OptimConfig


def _decayed(cfg: OptimConfig, progress: float, shape: str) -> float:
    """From lr (progress 0) to min_lr (progress 1) along `shape`."""
    if shape == "cosine":  # half-cosine (Loshchilov & Hutter 2017, SGDR eq. 5)
        kept = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif shape == "sqrt":  # 1 - sqrt (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
        kept = 1.0 - math.sqrt(progress)  # Beyond Fixed Training Durations", sec. 3)
    else:
        kept = 1.0 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * kept


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (counted from 0). Warmup: step s < W gives
    lr * (s + 1) / W, so step 0 gets lr / W and step W - 1 the peak lr. Then, by optim.schedule:
    cosine decays from the peak to min_lr at total_steps; wsd holds the peak and decays to
    min_lr over the last decay_fraction of total_steps (decay_shape); constant holds the peak."""
    peak_step = max(cfg.warmup_steps - 1, 0)
    if step < peak_step:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = min((step - peak_step) / max(total_steps - peak_step, 1), 1.0)
        return _decayed(cfg, progress, "cosine")
    # wsd: the decay starts where it leaves decay_fraction of the run, and never inside the warmup
    decay_start = max(peak_step, round(total_steps * (1.0 - cfg.decay_fraction)))
    if step < decay_start:
        return cfg.lr
    progress = min((step - decay_start) / max(total_steps - decay_start, 1), 1.0)
    return _decayed(cfg, progress, cfg.decay_shape)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that sets each group's lr to `lr_at(step)`, for groups whose initial lr is
    cfg.lr (as `build_optimizer` makes them); call its step() after each optimizer step."""

    def factor(step: int) -> float:
        # A plain function, which LambdaLR leaves out of its state_dict: nothing to pickle.
        return lr_at(step, cfg, total_steps) / cfg.lr if cfg.lr > 0 else 0.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
