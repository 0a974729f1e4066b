"""The plain PyTorch DDP loop benchmarks hold mshpc's engine against: what a torchtitan user writes
(torch's DistributedDataParallel, the optimizer mshpc would build, clip_grad_norm_), one step on a
fixed batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from mshpc.config import OptimConfig, ParallelConfig
from mshpc.model.gpt import loss_fn
from mshpc.optim.optimizer import build_optimizer


def ddp_train_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, parallel: ParallelConfig,
                   optim: OptimConfig,
                   autocast: torch.dtype | None = None) -> tuple[Callable[[], None], Callable[[], None]]:
    """(step, finish) of a DDP training step of `model` on (x, y); every rank of the default group
    builds it (DDP broadcasts the weights) and calls step() the same number of times. `autocast`:
    the forward and loss under torch.autocast of that dtype, as mshpc's train loop runs them."""
    ddp = DistributedDataParallel(model, bucket_cap_mb=parallel.bucket_mb)
    opt = build_optimizer(model, optim)

    def step() -> None:
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            loss = loss_fn(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, lambda: None
