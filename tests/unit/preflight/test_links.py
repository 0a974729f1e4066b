"""Pairing nodes in rounds, and locating a slow node or a slow link from the pair bandwidths."""

import itertools

import pytest

from mshpc.preflight.links import link_records, my_peer, schedule
from mshpc.preflight.record import Record
from mshpc.preflight.thresholds import load_thresholds
from mshpc.preflight.verdict import judge, verdict


@pytest.mark.parametrize("n", range(2, 10))
def test_every_pair_once_in_rounds_of_disjoint_pairs(n):
    rounds = schedule(n, max_nodes=32, bisections=4)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    for r in rounds:
        assert len({x for p in r for x in p}) == 2 * len(r)


def test_many_nodes_get_bisection_rounds_that_pair_everyone():
    rounds = schedule(100, max_nodes=32, bisections=3)
    assert len(rounds) == 3 and rounds == schedule(100, 32, 3)  # the same on every rank
    for r in rounds:
        assert sorted(x for p in r for x in p) == list(range(100))


def test_local_rank_k_meets_local_rank_k():
    by_node = [(0, 1), (2, 3), (4,)]
    assert my_peer([(0, 1)], by_node, 3) == (1, 0, 1)
    assert my_peer([(0, 2)], by_node, 1) is None  # node 2 has no local rank 1
    assert my_peer([(0, 2)], by_node, 4) == (0, 0, 2)


def pairs(values: dict[tuple[str, str], float]) -> list[dict]:
    return [{"a": a, "b": b, "rank": 0, "gbps": v, "wrong": 0, "size_bytes": 1 << 22} for (a, b), v in values.items()]


def judged(values):
    kinds = {n: "CPU" for pair in values for n in pair}
    v = verdict(judge(link_records(pairs(values), kinds), load_thresholds()), sorted(kinds))
    return v, [(r.node, r.device) for r in v.records if r.status == "fail"]


def test_a_node_whose_pairs_are_all_slow_is_blamed_alone():
    fast = {p: 1.0 for p in itertools.combinations(["a", "b", "c", "d"], 2)}
    v, failed = judged({**fast, ("a", "d"): 0.1, ("b", "d"): 0.12, ("c", "d"): 0.09})
    assert v.failed_nodes == ["d"]
    assert sorted(failed) == [("d", "a<->d"), ("d", "b<->d"), ("d", "c<->d"), ("d", "network")]


def test_a_slow_pair_between_good_nodes_is_that_link():
    fast = {p: 1.0 for p in itertools.combinations(["a", "b", "c", "d"], 2)}
    v, failed = judged({**fast, ("a", "b"): 0.1})
    assert v.failed_nodes == ["a", "b"]
    assert sorted(failed) == [("a", "a<->b"), ("b", "a<->b")]


def test_a_slow_pair_with_a_node_failing_its_gemm_is_blamed_on_that_node_alone():
    # seen on three local Slurm nodes: the node slowed by gemm_slow also slowed its pair, which
    # excluded its healthy partner too; the partner's own link passes and the pair is unused anyway
    fast = {p: 1.0 for p in itertools.combinations(["a", "b", "c"], 2)}
    kinds = {n: "CPU" for n in "abc"}
    gemms = [Record(n, "cpu/rank 0", "gemm_tflops", 0.25 if n == "c" else 1.0, "TFLOP/s", kind="CPU") for n in "abc"]
    v = verdict(judge(gemms + link_records(pairs({**fast, ("b", "c"): 0.5}), kinds), load_thresholds()), ["a", "b", "c"])
    assert v.failed_nodes == ["c"]
    failed = sorted((r.node, r.test, r.detail) for r in v.records if r.status == "fail")
    assert failed == [("c", "gemm_tflops", ""), ("c", "pair_gbps", "slow at a node that fails another test")]
