"""The 3D mesh: which (pp, dp, tp) coordinates a global rank has, and its process groups.

tp is innermost, so the ranks of one tensor-parallel group are consecutive and sit on one node
(their all-gathers and reduce-scatters are the most frequent and need the fastest link); dp is
next; pp is outermost (Megatron-LM's order; MegaScale sec. 3.2). `MeshShape` only does the
arithmetic, so the supervisor and the diagnosis can name a rank's coordinates without any
process group; `build_mesh` creates this rank's groups once at start-up.

Group creation (MegaScale sec. 3.5 cut it from 1,047 s to under 5 s on 2,048 GPUs by removing
global barriers and O(n^2) steps): each rank creates only the five groups it belongs to, with
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

# The order build_mesh creates groups in; every rank creates all five, in this order (see there).
GROUP_NAMES = ("tp", "dp", "pp", "mp", "embed")


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int

    def __str__(self) -> str:
        return f"(dp={self.dp}, tp={self.tp}, pp={self.pp})"


@dataclass(frozen=True)
class MeshShape:
    pp: int
    dp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> Coords:
        """The coordinates of global `rank`."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside a mesh of {self.world_size} ranks {self}")
        return Coords(pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp)

    def rank(self, c: Coords) -> int:
        """The global rank at coordinates `c`."""
        return (c.pp * self.dp + c.dp) * self.tp + c.tp

    def group_ranks(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The global ranks of each of `rank`'s groups, by name (GROUP_NAMES): tp, dp and pp vary
        one coordinate; mp (model parallel) is every rank with this dp coordinate, the group
        whose ranks together hold one copy of the model; embed is the first and last pp stage of
        this rank's pipeline (they both hold the tied embedding), a middle stage alone."""
        c = self.coords(rank)
        at = self.rank
        last = self.pp - 1
        embed = sorted({at(Coords(0, c.dp, c.tp)), at(Coords(last, c.dp, c.tp))})
        return {
            "tp": tuple(at(Coords(c.pp, c.dp, t)) for t in range(self.tp)),
            "dp": tuple(at(Coords(c.pp, d, c.tp)) for d in range(self.dp)),
            "pp": tuple(at(Coords(p, c.dp, c.tp)) for p in range(self.pp)),
            "mp": tuple(at(Coords(p, c.dp, t)) for p in range(self.pp) for t in range(self.tp)),
            "embed": tuple(embed) if c.pp in (0, last) else (rank,),
        }

    def all_groups(self) -> dict[str, list[tuple[int, ...]]]:
        """Every group of the job, by name: what a rank that creates all of them walks."""
        out: dict[str, list[tuple[int, ...]]] = {name: [] for name in GROUP_NAMES}
        for rank in range(self.world_size):
            for name, ranks in self.group_ranks(rank).items():
                if ranks not in out[name]:
                    out[name].append(ranks)
        return out


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

    @property
    def is_embedding_stage(self) -> bool:
        return self.coords.pp in (0, self.shape.pp - 1)


def build_mesh(shape: MeshShape, timeout: timedelta | None = None) -> Mesh:
    """Create this rank's five process groups (members-only: each group's creation involves its
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
