"""Mixtures of experts meet the mesh: expert parallelism (each ep rank keeps E / ep experts and
dispatches tokens to the others by all-to-all, parallel/expert_dispatch.py), the experts'
ZeRO domain over their expert-data-parallel group, and under tp the load statistics of a tp
group's sequence shards summed over it (the router's auxiliary loss is then the micro-batch's,
as at tp = 1).

Where mshpc differs from Megatron-Core: ep is carved out of dp alone and experts are not split
by tp (Megatron's expert tensor parallelism, etp, is 1 here); each tp rank routes its own 1/tp
sequence shard through its own ep group, so the experts are held tp times, as the norms are.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mshpc.config import ParallelConfig
from mshpc.model.moe import GroupedExperts, MoE, TokenShards
from mshpc.parallel import comm
from mshpc.parallel.expert_dispatch import AllToAllDispatch, overlapped_block
from mshpc.parallel.mesh import Mesh
from mshpc.parallel.zero import ShardDomain


def moe_modules(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    return ((name, m) for name, m in model.named_modules() if isinstance(m, MoE))


def apply_ep(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, micro_batch: int) -> ShardDomain | None:
    """Keep this ep rank's experts of every MoE layer (the whole model was built alike on every
    rank) and dispatch by all-to-all over the ep group, overlapped (parallel.ep_overlap) by
    cutting each MoE block's micro-batch into ep_overlap_chunks slices, or, with fewer
    sequences than that per micro-batch, each layer's tokens into chunks; returns the experts'
    ZeRO domain (over the edp group, each expert placed by its global index), or None at ep = 1.
    Collective over nothing: the groups exist (mesh)."""
    ep, group = mesh.shape.ep, mesh.ep
    if group is None:  # ep = 1: no expert groups
        return None
    rank = dist.get_rank(group)
    slices = parallel.ep_overlap and micro_batch >= parallel.ep_overlap_chunks > 1
    blocks = {f"{name}.mlp": block for name, block in model.named_modules() if isinstance(getattr(block, "mlp", None), MoE)}
    names = []
    for name, moe in moe_modules(model):
        experts = moe.experts
        local = experts.fc.shape[0] // ep
        experts.first_expert, experts.total_experts = rank * local, experts.fc.shape[0]
        span = slice(rank * local, (rank + 1) * local)
        experts.fc = nn.Parameter(experts.fc.detach()[span].clone())
        experts.proj = nn.Parameter(experts.proj.detach()[span].clone())
        moe.dispatch = AllToAllDispatch(group, moe.moe.n_experts, 1 if slices else parallel.ep_overlap_chunks,
                                        parallel.ep_overlap)
        if slices:
            blocks[name].forward = overlapped_block(blocks[name], parallel.ep_overlap_chunks)
        names += [f"{name}.experts.fc", f"{name}.experts.proj"]
    return ShardDomain(frozenset(names), mesh.edp, expert_placement(model))


def expert_placement(model: nn.Module) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each expert weight's whole shape (all E experts) and the flat offset of this rank's
    experts in it: checkpoints store experts by global index, whatever the ep."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, GroupedExperts):
            for key in ("fc", "proj"):
                p = getattr(m, key)
                per_expert = p[0].numel() if p.shape[0] else 0
                out[f"{name}.{key}"] = ((m.total_experts, *p.shape[1:]), m.first_expert * per_expert)
    return out


class TpTokenShards(TokenShards):
    """Under sequence parallelism the tp ranks of one micro-batch each route 1/tp of its tokens.
    sum: collective over the tp group (every tp rank routes every micro-batch alike)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, group=self.group)
        return t
