"""Bus bandwidth against values computed by hand from nccl-tests' formulas (doc/PERFORMANCE.md)."""

import pytest

from mshpc.errors import ConfigError
from mshpc.preflight.busbw import algbw_gbps, bus_factor, busbw_gbps
from mshpc.preflight.collectives import collective_records


@pytest.mark.parametrize("op, n, size, time_s, algbw, busbw", [
    ("all_reduce", 8, 1_000_000_000, 0.01, 100.0, 175.0),      # 100 x 2*7/8
    ("all_reduce", 2, 4_000_000, 0.001, 4.0, 4.0),              # 4 x 2*1/2
    ("all_reduce", 1, 1_000_000, 0.001, 1.0, 0.0),              # one rank moves nothing
    ("all_gather", 4, 4_000_000_000, 0.1, 40.0, 30.0),          # 40 x 3/4
    ("reduce_scatter", 4, 4_000_000_000, 0.1, 40.0, 30.0),
    ("all_to_all", 2, 2_000_000_000, 1.0, 2.0, 1.0),            # 2 x 1/2
    ("sendrecv", 16, 1_000_000_000, 0.5, 2.0, 2.0),             # x 1
    ("broadcast", 16, 1_000_000_000, 0.5, 2.0, 2.0),
    ("reduce", 3, 3_000_000_000, 1.5, 2.0, 2.0),
])
def test_busbw_matches_hand_computed_values(op, n, size, time_s, algbw, busbw):
    assert algbw_gbps(size, time_s) == pytest.approx(algbw)
    assert busbw_gbps(op, size, time_s, n) == pytest.approx(busbw)


def test_unknown_collective_names_the_valid_ones():
    with pytest.raises(ConfigError, match="'all_reduse'.*choose all_reduce, all_gather"):
        bus_factor("all_reduse", 4)


def test_report_averages_rank_times_before_the_formula_as_nccl_tests_does():
    # nccl-tests' default `-a 1`: the time is the mean over ranks (15 ms here), not the slowest
    raw = [{"group": "n1", "scope": "intra", "op": "all_reduce", "size_bytes": 4_000_000, "rank": r,
            "time_s": t, "wrong": 0} for r, t in enumerate([0.01, 0.01, 0.02, 0.02])]
    busbw, correct = collective_records(raw, ["n1"] * 4, ["CPU"] * 4)
    assert busbw.test == "intra_all_reduce_busbw_gbps" and busbw.node == "n1" and busbw.device == "ranks 0-3"
    assert busbw.value == pytest.approx(4_000_000 / 0.015 / 1e9 * 2 * 3 / 4)
    assert "slowest rank 2 20 ms" in busbw.detail
    assert (correct.test, correct.value) == ("all_reduce_wrong_elements", 0.0)
