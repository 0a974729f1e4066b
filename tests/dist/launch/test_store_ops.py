"""Start-up store traffic: rendezvous, every 3D group and a first collective in each, on real
gloo ranks against rank 0's real TCPStore (benchmarks/scale/rendezvous_scale.py, whose counting
store forwards every call), costs each rank the same number of store operations at 3 and at 6
ranks. Eagerly connected gloo read every member's address at each group's creation: 2(N-1) per
rank for the world group alone."""

from pathlib import Path

import pytest

SCALE = Path(__file__).resolve().parents[3] / "benchmarks" / "scale"


@pytest.fixture
def rendezvous_scale(monkeypatch):
    monkeypatch.syspath_prepend(str(SCALE))  # spawned ranks import the worker from there too
    import rendezvous_scale

    return rendezvous_scale


def test_store_operations_per_rank_do_not_grow_with_the_ranks(rendezvous_scale):
    # tp = pp = 1: the dp group and the world grow with N, the other three groups hold one rank
    small, large = (rendezvous_scale.run(n, lazy=True, tp=1, pp=1) for n in (3, 6))
    assert small["ops_per_rank_max"] == large["ops_per_rank_max"], (small, large)
    # each group publishes one address; an all-reduce's ring connects to its two neighbours, one
    # wait and one get each, in the dp group and in the world
    assert large["ops_total_by_op"] == {"set": 6 * 6, "wait": 6 * 4, "get": 6 * 4}, large
    assert large["ops_per_rank_max"] == 14
