import pytest

from mshpc.errors import ConfigError
from mshpc.mesh_shape import Coords, MeshShape


def test_tp_innermost_then_dp_then_pp():
    mesh = MeshShape(pp=2, dp=2, tp=2)
    assert [mesh.coords(r) for r in range(4)] == [
        Coords(pp=0, dp=0, tp=0), Coords(pp=0, dp=0, tp=1), Coords(pp=0, dp=1, tp=0), Coords(pp=0, dp=1, tp=1)
    ]
    assert mesh.coords(5) == Coords(pp=1, dp=0, tp=1)


def test_rank_inverts_coords():
    mesh = MeshShape(pp=3, dp=4, tp=2)
    assert [mesh.rank(mesh.coords(r)) for r in range(mesh.world_size)] == list(range(24))


def test_rank_outside_mesh_is_a_clear_error():
    with pytest.raises(ConfigError, match="rank 8 is outside a mesh of 8 ranks"):
        MeshShape(pp=2, dp=2, tp=2).coords(8)


def test_group_ranks_of_dp2_tp2_pp2():
    shape = MeshShape(pp=2, dp=2, tp=2)
    # rank 5 = (pp=1, dp=0, tp=1)
    assert shape.group_ranks(5) == {
        "tp": (4, 5), "dp": (5, 7), "pp": (1, 5), "mp": (0, 1, 4, 5), "embed": (1, 5), "ep": (5,), "edp": (5, 7),
    }


def test_expert_groups_are_carved_out_of_dp():
    """ep=2 of dp=4 (tp=2): blocks of 2 consecutive dp ranks split the experts, and the ranks at
    one place of every block hold the same experts (Megatron-Core's expert groups)."""
    shape = MeshShape(pp=1, dp=4, tp=2, ep=2)
    # rank 3 = (dp=1, tp=1): dp ranks 0, 1 of tp 1 are ranks 1, 3; dp 3 is rank 7
    assert shape.group_ranks(3)["ep"] == (1, 3) and shape.group_ranks(3)["edp"] == (3, 7)
    assert shape.group_ranks(4)["ep"] == (4, 6) and shape.group_ranks(4)["edp"] == (0, 4)
    groups = shape.all_groups()
    for name in ("ep", "edp"):
        assert sorted(r for g in groups[name] for r in g) == list(range(8)), name
    with pytest.raises(ConfigError, match="parallel.ep=3 does not divide dp=4"):
        MeshShape(pp=1, dp=4, tp=1, ep=3)


def test_middle_stages_embed_alone_and_ends_pair_up():
    shape = MeshShape(pp=4, dp=1, tp=2)
    assert shape.group_ranks(1)["embed"] == (1, 7)  # first stage, tp=1
    assert shape.group_ranks(7)["embed"] == (1, 7)  # last stage, tp=1
    assert shape.group_ranks(3)["embed"] == (3,)  # a middle stage holds no embedding
    assert shape.group_ranks(3)["pp"] == (1, 3, 5, 7)


def test_groups_of_one_name_partition_the_world():
    shape = MeshShape(pp=3, dp=2, tp=4)
    groups = shape.all_groups()
    for name in ("tp", "dp", "pp", "mp"):
        members = sorted(r for g in groups[name] for r in g)
        assert members == list(range(shape.world_size)), name
    assert len(groups["tp"]) == 6 and len(groups["dp"]) == 12 and len(groups["pp"]) == 8
    assert len(groups["mp"]) == 2 and all(len(g) == 12 for g in groups["mp"])
    # each rank's own groups are among them
    for rank in range(shape.world_size):
        for name, ranks in shape.group_ranks(rank).items():
            assert rank in ranks and ranks in groups[name]
