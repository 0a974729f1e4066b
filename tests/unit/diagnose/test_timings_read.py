"""Reading timings files at scale: the one-table fast path gives what parsing every line gives,
and falls back to it for anything it does not cover (a torn line, a restart, a phase only some
steps have); the live watch's arrays likewise."""

import json

import numpy as np

from mshpc.diagnose.stragglers import line_table, step_arrays
from mshpc.diagnose.timings import RankColumns, RankInfo, header, parse_records, rank_info, read_rank_file, step_table
from mshpc.mesh_shape import Coords

INFO = RankInfo(3, "node0", Coords(pp=0, dp=1, tp=1))


def line(step, **phases):
    return json.dumps({"step": step, "time": 1.0 + step, "step_s": sum(phases.values()), "spans": 4,
                       "phases": phases}) + "\n"


def by_parsing_each_line(path):
    headers, records = parse_records(path.read_text().splitlines())
    return RankColumns.of(rank_info(headers[-1]), records)


def same(a, b):
    assert a.info == b.info and a.steps.tolist() == b.steps.tolist()
    assert np.array_equal(a.step_s, b.step_s) and sorted(a.phases) == sorted(b.phases)
    for p in a.phases:
        assert np.array_equal(a.phases[p], b.phases[p]), p


def test_fast_path_reads_what_line_by_line_parsing_reads(tmp_path):
    path = tmp_path / "rank.jsonl"
    path.write_text(json.dumps(header(INFO, "cpu", 0)) + "\n"
                    + "".join(line(s, forward=0.1 * s, backward=0.2, **{"comm.all_reduce": 1e-7}) for s in range(1, 50)))
    assert step_table(path.read_bytes().partition(b"\n")[2]) is not None  # the fast path is taken
    fast = read_rank_file(path)
    same(fast, by_parsing_each_line(path))
    assert fast.steps.tolist() == list(range(1, 50)) and fast.phases["comm.all_reduce"][0] == 1e-7


def test_each_irregular_file_falls_back_and_agrees(tmp_path):
    head = json.dumps(header(INFO, "cpu", 0)) + "\n"
    cases = {
        "a phase only some steps have": head + line(1, forward=1.0) + line(2, forward=1.0, checkpoint=2.0),
        "keys in another order": head + line(1, forward=1.0, backward=2.0) + line(2, backward=2.0, forward=1.0),
        "a torn line, then a restart that repeats step 2": head + line(1, forward=1.0) + line(2, forward=1.0)[:-9]
        + "\n" + head + line(2, forward=3.0) + line(3, forward=1.0),
    }
    for name, text in cases.items():
        path = tmp_path / "rank.jsonl"
        path.write_text(text)
        fast = read_rank_file(path)
        same(fast, by_parsing_each_line(path))
        assert fast.steps.tolist() == sorted(set(fast.steps.tolist())), name
    assert fast.step_s.tolist() == [1.0, 3.0, 1.0]  # the repeated step keeps the restarted process's record


def test_step_table_refuses_a_value_that_is_not_a_number():
    assert step_table(b'{"step": 1, "step_s": "slow", "phases": {}}\n') is None
    assert step_table(b'{"step": 1, "step_s": 2.5, "phases": {"a b": 1.0}}\n') is None  # a space in a key


def test_watch_arrays_place_each_rank_and_step_and_leave_holes_nan():
    lines = [[line(5, forward=1.0).encode().strip(), line(6, forward=2.0).encode().strip(),
              line(7, forward=9.0).encode().strip()],
             [line(6, forward=4.0, data=0.5).encode().strip(), b'{"step": 7, "ti']]  # torn
    rows, index, column = line_table(lines)
    assert rows.tolist() == [0, 0, 0, 1] and index.tolist() == [0, 1, 2, 3]  # the torn line left out
    steps, step_s, phases = step_arrays(rows, column, 5, 6, 2)  # step 7: not every rank has it yet
    assert steps.tolist() == [5, 6]
    assert np.isnan(step_s[1, 0]) and step_s[0].tolist() == [1.0, 2.0] and step_s[1, 1] == 4.5
    assert phases["forward"][1, 1] == 4.0 and phases["data"][0].tolist() == [0.0, 0.0]
