"""Build the optimizer named by the config, with nanoGPT's weight-decay groups."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mshpc.config import OptimConfig
from mshpc.errors import ConfigError
from mshpc.optim.lamb import Lamb


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups, decay then no-decay: matrices (dim >= 2: linears, embeddings) decay; norms
    and biases do not (nanoGPT's rule). A tied weight appears once."""
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() dedups ties
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (torch's, foreach) or Lamb by cfg.name, at cfg.lr, over `param_groups`."""
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, foreach=True)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    raise ConfigError(f"optim.name={cfg.name!r} is not an optimizer (choose 'adamw' or 'lamb')")
