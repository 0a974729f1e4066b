import pytest

from mshpc.errors import ConfigError
from mshpc.parallel.mesh import Coords, MeshShape


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
