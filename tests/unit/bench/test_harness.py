"""The benchmark harness's arithmetic: the paired-round interval, the record, the turns."""

from __future__ import annotations

import json
import statistics

from mshpc.bench import harness


def test_the_interval_holds_the_ratio_of_medians_and_narrows_with_steady_rounds():
    steady_top = [[2.0 + 0.01 * (i % 3)] for i in range(20)]
    steady_bottom = [[1.0 + 0.005 * (i % 3)] for i in range(20)]
    low, high = harness.paired_round_interval(steady_top, steady_bottom)
    ratio = statistics.median(s for r in steady_top for s in r) / statistics.median(s for r in steady_bottom for s in r)
    assert low <= ratio <= high and high - low < 0.02
    noisy_top = [[2.0 * (1.3 if i % 4 == 0 else 1.0)] for i in range(20)]
    wide_low, wide_high = harness.paired_round_interval(noisy_top, steady_bottom)
    assert wide_high - wide_low > high - low


def test_the_interval_resamples_rounds_in_pairs():
    """A slow round slows both contenders of that round: paired, their ratio does not move."""
    top = [[1.0 * f] for f in (1, 3, 1, 3, 1, 3)]
    bottom = [[2.0 * f] for f in (1, 3, 1, 3, 1, 3)]
    assert harness.paired_round_interval(top, bottom) == (0.5, 0.5)


def test_a_record_names_its_baseline_and_carries_the_ratio_and_context():
    line = harness.record("ckpt", "blocking_s_vs_torch_save", 0.04, "s", 1.9, load_avg=[1.2, 1.4])
    assert line == {"bench": "ckpt", "metric": "blocking_s_vs_torch_save", "value": 0.04, "unit": "s",
                    "baseline": 1.9, "ratio": 0.02105, "load_avg": [1.2, 1.4]}
    assert "ratio" not in harness.record("ckpt", "state_size", 1.0, "GiB")
    json.dumps(line)  # one JSON line


def test_paired_gives_medians_the_ratio_and_its_interval():
    out = harness.paired([2.0, 2.2, 2.1], [1.0, 1.1, 1.0])
    assert out["value"] == 2.1 and out["baseline"] == 1.0 and out["ratio"] == 2.1
    assert out["ratio_90pct"][0] <= 2.1 <= out["ratio_90pct"][1] and out["rounds"] == 3


def test_turns_reverse_the_order_every_other_round():
    assert list(harness.turns(["a", "b", "c"], 3)) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
