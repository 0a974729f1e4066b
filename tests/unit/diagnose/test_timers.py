"""Phase timers on the CPU clock: nesting into self times, the owner thread only, the timings
file written by the background thread."""

import json
import threading
import time

import pytest
import torch

from mshpc.diagnose.timers import PhaseTimers, category
from mshpc.diagnose.timings import TimingsWriter, parse_lines


def timed_step(timers: PhaseTimers, step: int = 1):
    timers.begin_step(step)
    with timers.phase("forward"):
        time.sleep(0.02)
        with timers.phase("comm.all_gather"):
            time.sleep(0.01)
    with timers.phase("forward"):  # a second micro-batch adds to the same phase
        time.sleep(0.01)
    with timers.phase("optimizer"):
        time.sleep(0.005)
    return timers.end_step()


def test_nested_phases_keep_their_own_time_and_add_up_to_the_step():
    timers = PhaseTimers()
    timers.configure(True, torch.device("cpu"))
    spans = timed_step(timers)
    assert spans.ready()
    step_s, phases = spans.resolve()
    assert set(phases) == {"forward", "comm.all_gather", "optimizer", "other"}
    assert sum(phases.values()) == pytest.approx(step_s, rel=1e-9)  # self times partition the step
    # the all-gather inside forward is not forward's: forward is the 20 + 10 ms of its own
    assert phases["comm.all_gather"] >= 0.01 and phases["forward"] >= 0.03
    assert phases["forward"] < step_s - phases["comm.all_gather"]


def test_off_and_outside_a_step_and_other_threads_are_not_timed():
    timers = PhaseTimers()
    assert timed_step(timers) is None  # never configured: off
    timers.configure(True, torch.device("cpu"))
    with timers.phase("forward"):  # outside a step: nothing to attach it to
        pass
    timers.begin_step(1)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(timers.phase("comm.barrier").__enter__()))
    worker.start()
    worker.join()
    with timers.phase("data"):
        pass
    _, phases = timers.end_step().resolve()
    assert set(phases) == {"data", "other"}  # the saver-like thread's collective is not counted


def test_an_exception_inside_a_phase_leaves_a_consistent_step():
    timers = PhaseTimers()
    timers.configure(True, torch.device("cpu"))
    timers.begin_step(3)
    with pytest.raises(RuntimeError):
        with timers.phase("backward"):
            raise RuntimeError("boom")
    with timers.phase("optimizer"):
        pass
    _, phases = timers.end_step().resolve()
    assert set(phases) == {"backward", "optimizer", "other"}


def test_categories_of_the_breakdown():
    assert category("forward") == "compute" and category("attention") == "compute"
    assert category("comm.all_reduce") == "communication"
    assert category("comm.irecv") == "bubble" and category("pipeline.recv_wait") == "bubble"
    assert category("data") == "data wait" and category("checkpoint") == "checkpoint"


def test_a_restart_after_a_torn_line_keeps_its_header(tmp_path):
    # the previous attempt's last record was cut by a full disk: the restart's header must start
    # a line of its own, or every reader loses it (and with it where the restart began)
    path = tmp_path / "timings" / "rank-00000.jsonl"
    path.parent.mkdir()
    path.write_text('{"rank": 0, "host": "h", "pp": 0, "dp": 0, "tp": 0}\n{"step": 27, "time"')
    TimingsWriter(path, {"rank": 0, "host": "h2", "pp": 0, "dp": 0, "tp": 0}, flush_interval_s=60).close()
    headers, _ = parse_lines(path.read_text().splitlines())
    assert [h["host"] for h in headers] == ["h", "h2"]


def test_writer_thread_appends_a_header_and_one_line_per_step(tmp_path):
    timers = PhaseTimers()
    timers.configure(True, torch.device("cpu"))
    path = tmp_path / "timings" / "rank-00000.jsonl"
    seen_steps = []
    writer = TimingsWriter(path, {"rank": 0, "host": "h", "pp": 0, "dp": 0, "tp": 0}, flush_interval_s=60,
                           after_write=seen_steps.append)
    for step in (1, 2, 3):
        writer.put(timed_step(timers, step))
    writer.close()  # flushes what the 60 s interval held back
    headers, steps = parse_lines(path.read_text().splitlines())
    assert headers[0]["host"] == "h" and sorted(steps) == [1, 2, 3] and seen_steps == [1, 2, 3]
    assert set(steps[2]["phases"]) == {"forward", "comm.all_gather", "optimizer", "other"}
    assert all(json.loads(line) for line in path.read_text().splitlines())
