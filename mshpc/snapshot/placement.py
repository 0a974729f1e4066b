"""Which rank keeps a copy of each rank's in-memory snapshot: its buddy, on another node, so that
losing one node loses no state. Torch-free: the supervisor decides from it whether a failure can
be recovered in place (a lost rank's buddy must be alive), the ranks whom to send to.

The buddies form a ring over nodes among the ranks that hold the same part of the model (the
same tp and pp coordinates): the j-th such rank of a node keeps the snapshot of the j-th such rank
of the previous node. Its shard has the same size as the buddy's own, so every rank holds the
same bytes, and each rank keeps exactly one other rank's copy (the buddies are a permutation).
Where a group of such ranks does not span two nodes with as many of them on each (dp = 1, or
irregular nodes), the ring is over nodes among the ranks of the same local index instead; on a
single node the ring is over ranks, and a lost node cannot be survived (said by `why`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mshpc.mesh_shape import MeshShape


@dataclass(frozen=True)
class Buddies:
    """buddy[r] keeps rank r's snapshot; ward[b] is the rank whose snapshot rank b keeps."""

    buddy: tuple[int, ...]
    why: str  # how the ring was drawn, for the log

    @property
    def ward(self) -> tuple[int, ...]:
        out = [0] * len(self.buddy)
        for rank, b in enumerate(self.buddy):
            out[b] = rank
        return tuple(out)


def _by_node(ranks: Sequence[int], nodes: Sequence[str]) -> list[list[int]]:
    """`ranks` split by node, nodes in order of first appearance, ranks in order within each."""
    order: dict[str, list[int]] = {}
    for r in ranks:
        order.setdefault(nodes[r], []).append(r)
    return list(order.values())


def _ring(per_node: list[list[int]], buddy: list[int]) -> bool:
    """The j-th rank of each node kept by the j-th of the next; False when it cannot be drawn
    (fewer than two nodes, or nodes with different counts)."""
    if len(per_node) < 2 or len({len(ranks) for ranks in per_node}) != 1:
        return False
    for i, ranks in enumerate(per_node):
        keeper = per_node[(i + 1) % len(per_node)]
        for j, r in enumerate(ranks):
            buddy[r] = keeper[j]
    return True


def buddies(nodes: Sequence[str], shape: MeshShape) -> Buddies:
    """The buddy of every rank, from each rank's node name (`nodes[r]`) and the mesh."""
    world = len(nodes)
    assert world == shape.world_size, (world, shape)
    buddy = [-1] * world
    groups: dict[tuple[int, int], list[int]] = {}
    for r in range(world):
        c = shape.coords(r)
        groups.setdefault((c.tp, c.pp), []).append(r)
    if all(_ring(_by_node(members, nodes), buddy) for members in groups.values()):
        return Buddies(tuple(buddy), "a ring over nodes among the ranks with the same tp and pp coordinates")
    by_local: dict[int, list[int]] = {}
    for node_ranks in _by_node(range(world), nodes):
        for j, r in enumerate(node_ranks):
            by_local.setdefault(j, []).append(r)
    buddy = [-1] * world
    if all(_ring(_by_node(members, nodes), buddy) for members in by_local.values()):
        return Buddies(tuple(buddy), "a ring over nodes among the ranks with the same local index")
    return Buddies(tuple((r + 1) % world for r in range(world)),
                   "a ring over ranks: one node (or uneven nodes), so a lost node loses its snapshots")
