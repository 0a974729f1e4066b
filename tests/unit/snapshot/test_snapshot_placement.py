"""Every rank's snapshot is kept on another node, by a rank holding the same part of the model,
and every rank keeps exactly one other rank's."""

import pytest

from mshpc.mesh_shape import MeshShape
from mshpc.snapshot.placement import buddies


def _nodes(world: int, per_node: int) -> list[str]:
    return [f"n{r // per_node}" for r in range(world)]


@pytest.mark.parametrize(("shape", "per_node"), [
    (MeshShape(pp=1, dp=2, tp=1), 1),   # the chaos run: 2 ranks, one per slot
    (MeshShape(pp=1, dp=8, tp=1), 4),   # dp within and across nodes
    (MeshShape(pp=2, dp=4, tp=2), 4),
    (MeshShape(pp=1, dp=12288 // 8, tp=8), 8),  # the paper's size
])
def test_buddies_are_a_permutation_on_other_nodes_with_the_same_model_coordinates(shape, per_node):
    nodes = _nodes(shape.world_size, per_node)
    b = buddies(nodes, shape)
    assert sorted(b.buddy) == list(range(shape.world_size))  # each rank keeps exactly one copy
    for rank, keeper in enumerate(b.buddy):
        mine, theirs = shape.coords(rank), shape.coords(keeper)
        assert nodes[keeper] != nodes[rank]
        assert (mine.tp, mine.pp) == (theirs.tp, theirs.pp), (rank, keeper)
        assert b.ward[keeper] == rank
    assert "same tp and pp" in b.why


def test_the_ring_goes_over_nodes_in_order():
    b = buddies(_nodes(8, 4), MeshShape(pp=1, dp=8, tp=1))
    assert b.buddy == (4, 5, 6, 7, 0, 1, 2, 3)


@pytest.mark.parametrize(("shape", "per_node"), [
    (MeshShape(pp=2, dp=1, tp=2), 2),  # dp=1: no other copy of a stage's part anywhere
    (MeshShape(pp=2, dp=2, tp=4), 8),  # a node per stage: both dp copies of a part on one node
])
def test_without_a_peer_of_the_same_part_on_another_node_the_ring_is_over_local_indices(shape, per_node):
    nodes = _nodes(shape.world_size, per_node)
    b = buddies(nodes, shape)
    assert sorted(b.buddy) == list(range(shape.world_size)) and "local index" in b.why
    assert all(nodes[keeper] != nodes[rank] and keeper % per_node == rank % per_node
               for rank, keeper in enumerate(b.buddy))


def test_one_node_rings_over_ranks_and_says_a_node_loss_is_not_survived():
    b = buddies(["only"] * 4, MeshShape(pp=1, dp=4, tp=1))
    assert b.buddy == (1, 2, 3, 0) and "loses its snapshots" in b.why
