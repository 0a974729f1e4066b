"""The straggler detector on synthetic timings, fed through the same file format and arrays the
real runs use."""

import os
import threading
import time

import numpy as np
import pytest

from mshpc.config import DiagnoseConfig
from mshpc.diagnose.stragglers import StragglerWatch, detect, eviction_candidates, median_of_others
from mshpc.diagnose.timings import rank_file, to_arrays
from mshpc.events import read_events
from support.synthetic_timings import MESH, ranks, synthetic, watch_lines, write_files

def run_detector(records, cfg=DiagnoseConfig()):
    return detect(to_arrays(list(zip(ranks(), records))), cfg)


def test_median_of_others_leaves_each_rank_out():
    x = np.random.default_rng(0).random((5, 3))
    expected = np.stack([np.median(np.delete(x, i, axis=0), axis=0) for i in range(5)])
    assert np.allclose(median_of_others(x), expected)
    # two ranks: each one's reference is the other, so the slow one of a pair can be told
    assert median_of_others(np.array([1.0, 1.15])).tolist() == [1.15, 1.0]


def test_a_rank_15_percent_slower_from_step_50_is_flagged_within_20_steps():
    for seed in range(5):
        _, flags = run_detector(synthetic(200, seed, slow_rank=5, slow_from=50))
        assert [f.rank for f in flags] == [5], (seed, flags)
        flag = flags[0]
        assert 50 <= flag.since_step < 70, flag
        assert flag.category == "compute" and flag.relative_score < 0.9
        # reported with its host and its (dp, tp, pp): rank 5 = pp 1, dp 0, tp 1 (tp innermost)
        assert (flag.host, flag.pp, flag.dp, flag.tp) == ("node1", 1, 0, 1)


def test_no_false_positive_on_1000_noisy_healthy_steps():
    for seed in range(5):
        detector, flags = run_detector(synthetic(1000, seed))
        assert flags == [] and detector.current() == []


def test_data_wait_straggler_names_its_phase():
    records = synthetic(120, seed=1, slow_rank=2, slow_from=40, slow_phases=("data",), factor=40.0)
    _, flags = run_detector(records)
    assert [(f.rank, f.category, f.phase) for f in flags] == [(2, "data wait", "data")]


def test_a_rank_slow_in_validation_is_not_blamed():
    # every step evaluates (eval.interval_steps=1) and rank 2's validation takes 3x the
    # others': counted as compute that would flag it; its own phase, it is not blamed
    records = synthetic(120, seed=1)
    for step in range(1, 121):
        for r, rank_records in enumerate(records):
            rec = rank_records[step]
            rec["phases"]["eval"] = 0.5 * (3 if r == 2 else 1)
            rec["step_s"] += rec["phases"]["eval"]
    detector, flags = run_detector(records)
    assert flags == [] and detector.current() == []


def test_individual_score_tells_a_rank_that_slowed_down_from_one_that_was_always_slow():
    late = run_detector(synthetic(200, 3, slow_rank=1, slow_from=100, factor=1.3))[0].current()
    always = run_detector(synthetic(200, 3, slow_rank=1, slow_from=0, factor=1.3))[0].current()
    assert [s.rank for s in late] == [1] and [s.rank for s in always] == [1]
    # 1/1.3 = 0.77 against its own best window; about 1 (less the noise of a best-of) for the other
    assert late[0].individual_score == pytest.approx(1 / 1.3, abs=0.05)
    assert always[0].individual_score > 0.9


def test_eviction_candidates_from_the_run_directory(tmp_path):
    write_files(tmp_path, synthetic(120, 0, slow_rank=6, slow_from=30, factor=1.5))
    [candidate] = eviction_candidates(tmp_path)
    assert (candidate.rank, candidate.host, candidate.dp, candidate.tp, candidate.pp) == (6, "node1", 1, 0, 1)
    assert candidate.step == 120 and candidate.since_step < 50
    write_files(tmp_path / "healthy", synthetic(120, 0))
    assert eviction_candidates(tmp_path / "healthy") == []


def test_live_watch_reads_growing_files_and_writes_one_event(tmp_path):
    records = synthetic(100, 4, slow_rank=3, slow_from=20, factor=1.5)
    cfg = DiagnoseConfig(watch_ranks_per_file=4)
    watch = StragglerWatch(tmp_path, MESH.world_size, cfg, start_step=0)
    steps, writers = watch_lines(tmp_path, records)
    fds = [os.open(w.path, os.O_WRONLY) for w in writers]
    for lo in range(0, 100, 25):  # steps in chunks, each rank's last watch record torn
        torn = []
        for r in range(MESH.world_size):
            _append(tmp_path, steps, writers, r, lo, lo + 24)
            with rank_file(tmp_path, r).open("ab") as f:
                f.write(steps[r][lo + 24][0])
            writers[r].add(*steps[r][lo + 24][1])
            [(offset, data)] = writers[r].take_encoded()
            os.pwrite(fds[r], data[:-7], offset)  # half a record now ...
            torn.append((offset + len(data) - 7, data[-7:]))
        watch.poll()
        for fd, (offset, rest) in zip(fds, torn, strict=True):
            os.pwrite(fd, rest, offset)  # ... the rest later
    watch.poll()
    watch.close()
    for fd, w in zip(fds, writers, strict=True):
        os.close(fd)
        w.close()
    events = [e for e in read_events(tmp_path) if e["kind"] == "straggler"]
    assert events[0]["phase"] in ("forward", "backward", "optimizer")  # read from its JSON line
    assert [(e["rank"], e["evict_candidate"]) for e in events] == [(3, True)]
    assert 20 <= events[0]["since_step"] < 40


def _append(tmp_path, steps, writers, r, lo, hi):
    lines, recs = zip(*steps[r][lo:hi], strict=True)
    with rank_file(tmp_path, r).open("ab") as f:
        f.write(b"".join(lines))
    for rec in recs:
        writers[r].add(*rec)
    writers[r].flush()


def test_end_of_run_look_waits_for_the_ranks_still_closing(tmp_path):
    # the slow rank's last 60 steps reach its stream only as it closes, after rank 0's last look
    # began (a long flush interval): that look must wait for them, not judge 40 steps and stop
    records = synthetic(100, 4, slow_rank=3, slow_from=50, factor=1.5)
    watch = StragglerWatch(tmp_path, MESH.world_size, DiagnoseConfig(watch_ranks_per_file=4), start_step=0)
    steps, writers = watch_lines(tmp_path, records)
    for r in range(MESH.world_size):
        _append(tmp_path, steps, writers, r, 0, 40 if r == 3 else 100)
    closing = threading.Timer(0.3, _append, (tmp_path, steps, writers, 3, 40, 100))
    closing.start()
    flagged = watch.poll_until(100, timeout_s=30)
    closing.join()
    assert [s.rank for s in flagged] == [3] and flagged[0].since_step >= 50
    watch.close()


def test_end_of_run_look_gives_up_on_a_rank_that_never_closes(tmp_path, caplog):
    records = synthetic(40, 4)
    watch = StragglerWatch(tmp_path, MESH.world_size, DiagnoseConfig(watch_ranks_per_file=4), start_step=0)
    steps, writers = watch_lines(tmp_path, records)
    for r in range(MESH.world_size):
        _append(tmp_path, steps, writers, r, 0, 30 if r == 1 else 40)
    start = time.monotonic()
    assert watch.poll_until(40, timeout_s=0.5) == []
    assert 0.5 <= time.monotonic() - start < 5
    # the missing rank is named, with the steps left unjudged
    assert "1 rank(s) never recorded step 40, its last 10 step(s) not judged: ranks 1" in caplog.text
    # a run that trained no step (resumed at its last) has nothing to wait for
    start = time.monotonic()
    assert StragglerWatch(tmp_path / "none", MESH.world_size, DiagnoseConfig(), start_step=40).poll_until(40, 30) == []
    assert time.monotonic() - start < 5
    watch.close()


@pytest.mark.parametrize("factor, warned", [(1.12, False), (1.2, False), (1.6, True)],
                         ids=["noise-12pc", "noise-20pc", "slow-60pc"])
def test_the_live_watch_warns_only_below_the_floor_and_records_every_flag(tmp_path, caplog, factor, warned):
    records = synthetic(80, 4, slow_rank=3, slow_from=10, factor=factor)
    watch = StragglerWatch(tmp_path, MESH.world_size, DiagnoseConfig(watch_ranks_per_file=4), start_step=0)
    steps, writers = watch_lines(tmp_path, records)
    for r in range(MESH.world_size):
        _append(tmp_path, steps, writers, r, 0, 80)
    with caplog.at_level("DEBUG", logger="mshpc.diagnose.stragglers"):
        flagged = watch.poll_until(80, timeout_s=30)
    watch.close()
    for w in writers:
        w.close()
    assert [s.rank for s in flagged] == [3]  # flagged either way: an event for the supervisor and the report
    assert [e["rank"] for e in read_events(tmp_path) if e["kind"] == "straggler"] == [3]
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.getMessage().startswith("straggler:")]
    assert len(warnings) == (1 if warned else 0), [r.getMessage() for r in caplog.records]
