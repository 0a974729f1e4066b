"""The single-rank training that the parallel engines' parity tests compare against: the whole
global batch at once, torch's clipping, the unsharded optimizer."""

from __future__ import annotations

import torch

from mshpc.config import ModelConfig, OptimConfig
from mshpc.model.gpt import GPT, loss_fn
from mshpc.optim.optimizer import build_optimizer

GRAD_CLIP = 0.05  # below the gradient norms of these runs' steps: clipping acts in every step


def optim_cfg(name: str, eps: float = 1e-8) -> OptimConfig:
    return OptimConfig(name=name, lr=1e-2, weight_decay=0.1, grad_clip=GRAD_CLIP, eps=eps)


def global_batch(cfg: ModelConfig, sequences: int, step: int) -> torch.Tensor:
    """Step `step`'s global batch (sequences, seq_len + 1), the same in every process."""
    return torch.randint(0, cfg.vocab_size, (sequences, cfg.seq_len + 1),
                         generator=torch.Generator().manual_seed(100 + step))


def train_reference(cfg: ModelConfig, optim: OptimConfig, steps: int, sequences: int
                    ) -> tuple[GPT, torch.optim.Optimizer, list[float], list[float]]:
    """Train GPT(cfg) from seed 0 for `steps` steps of `sequences` sequences, clipping at
    optim.grad_clip; returns it, its optimizer, the losses and the grad norms before clipping."""
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = build_optimizer(model, optim)
    losses, norms = [], []
    for step in range(steps):
        b = global_batch(cfg, sequences, step)
        loss = loss_fn(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, optimizer, losses, norms
