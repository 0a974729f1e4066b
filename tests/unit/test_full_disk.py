"""A real full disk (a small tmpfs of the test's own, root only) under the run files' writers: under
recovery.in_place (a grace) their lines wait in memory and are written, whole and in order, when
space returns; past the grace, or without it, the write fails as before (one line, exit 2)."""

import threading
import time

import pytest
from support.tmpfs import mounted_tmpfs

from mshpc import full_disk
from mshpc.bench.disk_fill import fill
from mshpc.errors import RunEnvironmentError
from mshpc.events import append_event, read_events
from mshpc.run_dir import MetricsLog, read_metrics


@pytest.fixture
def disk(tmp_path):
    with mounted_tmpfs(tmp_path / "disk", "1m") as mnt:
        yield mnt


@pytest.fixture
def grace():
    """Set the process-wide grace for one test, and put back the default (none) after it."""
    yield full_disk.hold_for
    full_disk.hold_for(0.0)


def row(step: int) -> dict:
    """A metrics row of more than a page: tmpfs gives a file its space a page at a time, so a
    smaller line could still fit the page the last one began and miss the full disk."""
    return {"step": step, "loss": 4.0 - step / 10, "pad": "x" * 4096}


def free_later(filler, after_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after_s), filler.unlink()))
    thread.start()
    return thread


def test_metrics_lines_refused_by_a_full_disk_are_written_in_order_when_space_returns(disk, grace, caplog):
    grace(30.0)
    log = MetricsLog(disk / "metrics.jsonl", start_step=0)
    log.write(row(1))
    filler = fill(disk)
    for step in (2, 3, 4):  # refused: held, training goes on
        log.write(row(step))
    assert len(log._file.held) > 0
    assert [r["step"] for r in read_metrics(disk / "metrics.jsonl")] == [1]
    filler.unlink()
    log.write(row(5))
    log.close()
    assert [r["step"] for r in read_metrics(disk / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    said = [r.getMessage() for r in caplog.records if r.name == "mshpc.full_disk"]
    assert len(said) == 2 and "holding its lines in memory for up to 30 s" in said[0] and "written again" in said[1]


def test_close_waits_for_space_within_the_grace(disk, grace):
    grace(30.0)
    log = MetricsLog(disk / "metrics.jsonl", start_step=0)
    filler = fill(disk)
    log.write(row(1))
    thread = free_later(filler, 0.5)
    log.close()  # blocks until the filler is gone
    thread.join()
    assert [r["step"] for r in read_metrics(disk / "metrics.jsonl")] == [1]


def test_a_disk_full_past_the_grace_fails_with_one_line(disk, grace):
    grace(0.3)
    log = MetricsLog(disk / "metrics.jsonl", start_step=0)
    fill(disk)
    log.write(row(1))  # held
    time.sleep(0.4)
    with pytest.raises(RunEnvironmentError, match=r"cannot write .*metrics.jsonl: no space left on its file system"):
        log.write(row(2))
    log.close()  # what is held is not tried again: the error was said


def test_without_a_grace_a_full_disk_fails_at_once(disk):
    assert full_disk.grace_s() == 0.0  # the default: recovery.in_place off
    log = MetricsLog(disk / "metrics.jsonl", start_step=0)
    fill(disk)
    with pytest.raises(RunEnvironmentError, match="no space left on its file system"):
        log.write(row(1))
    log.close()


def test_an_event_torn_by_the_disk_filling_mid_line_is_written_whole_after_it(disk, grace):
    grace(30.0)
    append_event(disk, "first")
    path = disk / "events.jsonl"
    # a file that ends 10 bytes before its page does: the next line's first 10 bytes fit in the
    # page tmpfs has already given it, the rest needs a page the full disk no longer has
    with open(path, "ab") as f:
        f.write(b'{"kind": "pad", "x": "' + b"x" * (4096 - 10 - path.stat().st_size - 25) + b'"}\n')
    assert path.stat().st_size == 4086
    filler = fill(disk)
    thread = free_later(filler, 0.5)
    append_event(disk, "second", detail="y" * 100)  # torn at 10 bytes, then whole once space returns
    thread.join()
    lines = path.read_bytes().split(b"\n")
    assert len(lines[2]) == 10  # the torn part, ended by a newline: readers skip it
    assert [e["kind"] for e in read_events(disk)] == ["first", "pad", "second"]


def test_the_timings_thread_holds_its_lines_and_the_watch_records_that_point_into_them(disk, grace, caplog):
    import json

    from mshpc.diagnose.timers import CpuClock, StepSpans
    from mshpc.diagnose.timings import TimingsWriter, parse_lines
    from mshpc.diagnose.watch_stream import StreamReader, StreamWriter

    grace(30.0)
    head = {"rank": 0, "host": "h", "pp": 0, "dp": 0, "tp": 0, "clock": "wall", "start_step": 0}
    # 4 ranks a file: the header slots fill the first page, rank 0's records start the second
    stream = StreamWriter(disk, 0, head, start_step=0, ranks_per_file=4)
    head = {**head, "host": "h" * (4096 - len(json.dumps(head)))}  # a line of one page: a step line needs the next
    path = disk / "timings" / "rank-00000.jsonl"
    writer = TimingsWriter(path, head, 0.05, stream=stream)
    assert path.stat().st_size == 4096
    filler = fill(disk)
    for step in (1, 2, 3):  # the thread flushes after a step's line once flush_interval_s has passed
        start = time.perf_counter()
        writer.put(StepSpans(step, [["step", -1, start, start + 0.01]], CpuClock()))
        time.sleep(0.1)  # so each flush falls in the full disk: held, the thread alive
    assert path.stat().st_size == 4096
    filler.unlink()
    writer.close()
    _, records = parse_lines(path.read_text().splitlines())
    assert sorted(records) == [1, 2, 3]
    reader = StreamReader(disk, 1, start_step=0, ranks_per_file=4)
    watched, ranks = reader.read_new()
    reader.close()
    assert watched["step"].tolist() == [1, 2, 3] and ranks.tolist() == [0, 0, 0]
    said = [r.getMessage() for r in caplog.records if r.name == "mshpc.full_disk"]
    assert any(str(path) in m and "holding its lines" in m for m in said), [r.getMessage() for r in caplog.records]
