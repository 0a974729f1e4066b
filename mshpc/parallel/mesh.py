"""This rank's place in the 3D mesh and its process groups; the rank arithmetic (`MeshShape`,
`Coords`) is torch-free in `mshpc.mesh_shape`, and `build_mesh` creates this rank's groups once
at start-up.

Group creation (MegaScale sec. 3.5 cut it from 1,047 s to under 5 s on 2,048 GPUs by removing
global barriers and O(n^2) steps): each rank creates only the groups it belongs to (five; seven
with expert parallelism), with `use_local_synchronization=True`, so a group's creation involves its members only and no rank
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
    # The dp ranks a mixture of experts' experts are split over (expert parallelism); None at
    # ep = 1, where nothing is split and no group is made.
    ep: dist.ProcessGroup | None
    edp: dist.ProcessGroup  # the dp ranks that hold this rank's experts too: the dp group at ep = 1

    def distinct_groups(self) -> list[dist.ProcessGroup]:
        """This rank's groups, each once (at ep = 1 edp is the dp group and ep is none)."""
        groups = (getattr(self, name) for name in GROUP_NAMES)
        return list({id(g): g for g in groups if g is not None}.values())

    @property
    def is_embedding_stage(self) -> bool:
        return self.coords.pp in (0, self.shape.pp - 1)


def build_mesh(shape: MeshShape, timeout: timedelta | None = None) -> Mesh:
    """Create this rank's process groups, five, seven with expert parallelism (members-only: each
    group's creation involves its own ranks and no other). Every rank of the default group must
    call it, before any other group is created with use_local_synchronization: torch names such
    groups by a hash of their ranks and of how many groups the process made before, so every rank
    creates the same number of groups here, in the same order (a middle stage's embed group is
    itself alone)."""
    if not dist.is_initialized():
        raise ConfigError("build_mesh needs torch.distributed initialised (launch.rendezvous.init_distributed)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != shape.world_size:
        raise ConfigError(f"mesh {shape} needs {shape.world_size} ranks, the job has {world} "
                          f"(launch a multiple of tp*pp={shape.tp * shape.pp} ranks)")
    ranks = shape.group_ranks(rank)
    groups: dict[str, dist.ProcessGroup] = {}
    # At ep = 1 the expert groups would be the dp group and this rank alone: a dense job makes no
    # extra groups (each costs a store address per rank at start-up, 24,576 at 12,288 ranks).
    names = GROUP_NAMES if shape.ep > 1 else tuple(n for n in GROUP_NAMES if n not in ("ep", "edp"))
    for name in names:
        # The group's members reach this call in this order too, so creation cannot deadlock.
        groups[name] = dist.new_group(list(ranks[name]), timeout=timeout, use_local_synchronization=True,
                                      group_desc=f"mesh_{name}")
    if shape.ep == 1:
        groups["edp"] = groups["dp"]
    return Mesh(shape=shape, rank=rank, coords=shape.coords(rank), ep=groups.pop("ep", None), **groups)
