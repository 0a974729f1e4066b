"""The end of every optimizer step, one tail for the plain step (train.py) and the pipeline step
(pipeline.py): the step's loss all-reduced while the clipped update runs."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mshpc.diagnose.timers import phase
from mshpc.parallel import comm
from mshpc.parallel.zero import ZeroEngine
from mshpc.phases import OPTIMIZER


def clipped_update(engine: ZeroEngine, loss_sum: torch.Tensor, *, grad_clip: float,
                   loss_group: dist.ProcessGroup | None, loss_terms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Update the engine's shard, its gradients clipped to `grad_clip` (0: no clipping), and sum
    `loss_sum` over `loss_group` (None: the world). Collective over the mesh: every rank calls it.
    Returns the loss divided by `loss_terms` and the global grad norm before clipping."""
    # Started before step() queues the parameter all-gathers, so waiting for it (and the .item()
    # the loop does) never waits for them: they overlap the next forward.
    loss_reduce = comm.all_reduce(loss_sum, group=loss_group, async_op=True)
    with phase(OPTIMIZER):
        grad_norm = engine.step(grad_clip if grad_clip > 0 else math.inf)
    if loss_reduce is not None:
        loss_reduce.wait()
    return loss_sum / loss_terms, grad_norm
