"""Plain data parallelism: average gradients across the dp group after backward.

One flat bucket per dtype keeps it to a single collective per step. The ZeRO engine
(sharded optimizer state, overlapped reduce-scatter) replaces this.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mshpc.parallel import comm


def allreduce_gradients(model: nn.Module, group: dist.ProcessGroup | None, dp_size: int) -> None:
    """Collective over the dp group: every rank's grads become the dp mean."""
    if dp_size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for bucket in by_dtype.values():
        flat = _flatten_dense_tensors(bucket)
        comm.all_reduce(flat, group=group)
        flat.div_(dp_size)
        for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(synced)

