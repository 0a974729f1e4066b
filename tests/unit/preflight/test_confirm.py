"""The confirmation rule: a slow rate (a device test, a pair, a node's link) excludes a node only
when every one of its k samples fails; one noisy sample is measured again and forgiven; the fleet
median stays on the first samples; an unconfirmed failure only warns."""

import itertools

from mshpc.preflight.confirm import Todo, add_samples, first_sample, settle, to_confirm
from mshpc.preflight.links import disjoint_rounds, link_records
from mshpc.preflight.record import Record
from mshpc.preflight.thresholds import load_thresholds
from mshpc.preflight.verdict import judge, verdict

K = 3
NODES = ["a", "b", "c", "d"]
KINDS = {n: "CPU" for n in NODES}


def exchanges(values: dict[tuple[str, str], float], sample: int = 0) -> list[dict]:
    """Both ends' measurements of each pair, as every rank reports them."""
    return [{"a": a, "b": b, "rank": rank, "gbps": v, "wrong": 0, "size_bytes": 1 << 20, "sample": sample}
            for (a, b), v in values.items() for rank in (0, 1)]


def fleet(**slow: float) -> dict[tuple[str, str], float]:
    """Every pair of NODES at 1 GB/s, but the ones named like a_b=0.1."""
    values = {pair: 1.0 for pair in itertools.combinations(NODES, 2)}
    values.update({tuple(name.split("_")): v for name, v in slow.items()})
    return values


def judged(raw: list[dict]) -> list[Record]:
    return judge(link_records(raw, KINDS), load_thresholds())


def pair_record(records: list[Record], pair: str) -> Record:
    return next(r for r in records if r.test == "pair_gbps" and r.device == pair)


def test_a_pair_slow_once_is_measured_again_and_not_excluded():
    first = exchanges(fleet(a_b=0.1))  # one noisy sample: today it excluded a and b
    assert to_confirm(judged(first), K) == Todo({("a", "b"): 1}, {})  # only the flagged pair is measured again
    again = first + exchanges({("a", "b"): 0.97}, sample=1) + exchanges({("a", "b"): 1.01}, sample=2)
    records = judged(again)
    assert not to_confirm(records, K)
    v = verdict(settle(records, K), NODES)
    assert v.failed_nodes == [] and v.status == "pass"
    ab = pair_record(v.records, "a<->b")
    assert (ab.status, ab.samples, ab.failed, ab.value) == ("pass", [0.1, 0.97, 1.01], 1, 1.01)


def test_a_pair_slow_in_every_sample_is_excluded_and_says_so():
    again = [r for j, v in ((1, 0.12), (2, 0.1)) for r in exchanges({("a", "b"): v}, sample=j)]
    records = judged(exchanges(fleet(a_b=0.11)) + again)
    assert not to_confirm(records, K)  # three samples: nothing left to confirm
    v = verdict(settle(records, K), NODES)
    assert v.failed_nodes == ["a", "b"]
    failures = [r for r in v.records if r.status == "fail"]
    assert {(r.node, r.device) for r in failures} == {("a", "a<->b"), ("b", "a<->b")}
    assert all((len(r.samples), r.failed) == (3, 3) for r in failures)


def test_a_node_slow_on_its_own_link_has_all_its_pairs_measured_again():
    slow_d = {"a_d": 0.1, "b_d": 0.12, "c_d": 0.09}
    first = exchanges(fleet(**slow_d))
    assert to_confirm(judged(first), K) == Todo({("a", "d"): 1, ("b", "d"): 1, ("c", "d"): 1}, {})
    more = [exchanges({tuple(p.split("_")): v * 1.1 for p, v in slow_d.items()}, sample=j) for j in (1, 2)]
    v = verdict(settle(judged(first + more[0] + more[1]), K), NODES)
    assert v.failed_nodes == ["d"]
    link = next(r for r in v.records if r.test == "link_gbps" and r.node == "d")
    assert (link.status, len(link.samples), link.failed) == ("fail", 3, 3)


def test_a_failure_the_budget_left_unconfirmed_warns_and_excludes_nothing():
    records = settle(judged(exchanges(fleet(a_b=0.1))), K)
    v = verdict(records, NODES)
    assert v.failed_nodes == [] and v.nodes["a"] == "warn" and v.status == "warn"
    ab = [r for r in records if r.device == "a<->b"]
    assert ab and all(r.status == "warn" and "not confirmed: 1 of 3 samples" in r.detail for r in ab)


def test_a_pair_measured_once_is_not_held_against_the_best_of_others_measured_again():
    # seen on the shared machine: n1's two pairs slow in the first pass and fine again; the median
    # of the links stays on the first samples, so the n2-n3 pair measured once still passes
    nodes = ["n1", "n2", "n3"]
    first = exchanges({("n1", "n2"): 0.31, ("n1", "n3"): 0.123, ("n2", "n3"): 0.604})
    kinds = {n: "CPU" for n in nodes}
    todo = to_confirm(judge(link_records(first, kinds), load_thresholds()), K)
    assert todo == Todo({("n1", "n2"): 1, ("n1", "n3"): 1}, {})
    again = [r for j, (ab, ac) in ((1, (1.073, 1.184)), (2, (0.664, 0.281)))
             for r in exchanges({("n1", "n2"): ab, ("n1", "n3"): ac}, sample=j)]
    v = verdict(settle(judge(link_records(first + again, kinds), load_thresholds()), K), nodes)
    assert v.failed_nodes == [] and v.status == "pass"


def gemm(node: str, rank: int, value: float) -> Record:
    return first_sample(Record(node, f"cpu/rank {rank}", "gemm_tflops", value, "TFLOP/s", kind="CPU", rank=rank))


def test_a_device_test_slow_once_runs_again_on_its_rank_and_slow_every_time_is_excluded():
    records = [gemm("n1", 0, 1.0), gemm("n2", 1, 1.02), gemm("n3", 2, 0.25), gemm("n4", 3, 0.3)]
    todo = to_confirm(judge(records, load_thresholds()), K)
    assert todo == Todo({}, {(2, "gemm_tflops"): 1, (3, "gemm_tflops"): 1})
    # rank 2 slow every time (a slow device), rank 3 was a burst of load
    again = [{"rank": rank, "test": "gemm_tflops", "value": v, "sample": j}
             for rank, values in ((2, (0.24, 0.26)), (3, (0.97, 0.5))) for j, v in enumerate(values, start=1)]
    records = judge(add_samples(records, again), load_thresholds())
    assert not to_confirm(records, K)
    v = verdict(settle(records, K), ["n1", "n2", "n3", "n4"])
    assert v.failed_nodes == ["n3"]
    assert [(r.status, r.samples, r.failed) for r in v.records[2:]] == [
        ("fail", [0.25, 0.24, 0.26], 3), ("pass", [0.3, 0.97, 0.5], 2)]  # below 0.8 x median 0.65


def test_pairs_to_measure_again_go_in_rounds_where_no_node_is_busy_twice():
    rounds = disjoint_rounds([(0, 3), (1, 3), (2, 3), (0, 1)])
    assert rounds == [[(0, 3)], [(1, 3)], [(2, 3), (0, 1)]]
