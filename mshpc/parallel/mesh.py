"""This rank's place in the 3D mesh and its process groups; the rank arithmetic (`MeshShape`,
`Coords`) is torch-free in `mshpc.mesh_shape`, and `build_mesh` creates this rank's groups once
at start-up.

Group creation (MegaScale sec. 3.5 cut it from 1,047 s to under 5 s on 2,048 GPUs by removing
global barriers and O(n^2) steps): each rank creates only the seven groups it belongs to, with
`use_local_synchronization=True`, so a group's creation involves its members only and no rank
walks the list of every group in the job. torch's `split_group` (one ncclCommSplit per mesh
dimension) needs NCCL and a device bound to the default group, and would make every split a
collective over the whole world; members-only groups work alike on gloo and on lazily
initialised NCCL. benchmarks/init_groups.py measures both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from mshpc.errors import ConfigError
from mshpc.mesh_shape import GROUP_NAMES, Coords, MeshShape


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the mesh and its process groups. A module that communicates takes
    the one group it needs (`mesh.tp`, ...), never the mesh's world."""

    shape: MeshShape
    rank: int
    coords: Coords
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup
    mp: dist.ProcessGroup  # tp x pp at this dp coordinate: sums that span one model copy (grad norm)
    embed: dist.ProcessGroup  # first + last pp stage of this pipeline; a middle stage: itself alone
    ep: dist.ProcessGroup  # the dp ranks a mixture of experts' experts are split over (expert parallelism)
    edp: dist.ProcessGroup  # the dp ranks that hold this rank's experts too (expert data parallelism)

    @property
    def is_embedding_stage(self) -> bool:
        return self.coords.pp in (0, self.shape.pp - 1)


def build_mesh(shape: MeshShape, timeout: timedelta | None = None) -> Mesh:
    """Create this rank's seven process groups (members-only: each group's creation involves its
    own ranks and no other). Every rank of the default group must call it, before any other
    group is created with use_local_synchronization: torch names such groups by a hash of their
    ranks and of how many groups the process made before, so every rank creates the same number
    of groups here, in the same order (a middle stage's embed group is itself alone)."""
    if not dist.is_initialized():
        raise ConfigError("build_mesh needs torch.distributed initialised (launch.rendezvous.init_distributed)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != shape.world_size:
        raise ConfigError(f"mesh {shape} needs {shape.world_size} ranks, the job has {world} "
                          f"(launch a multiple of tp*pp={shape.tp * shape.pp} ranks)")
    ranks = shape.group_ranks(rank)
    groups = {}
    for name in GROUP_NAMES:
        # The group's members reach this call in this order too, so creation cannot deadlock.
        groups[name] = dist.new_group(list(ranks[name]), timeout=timeout, use_local_synchronization=True,
                                      group_desc=f"mesh_{name}")
    return Mesh(shape=shape, rank=rank, coords=shape.coords(rank), **groups)
