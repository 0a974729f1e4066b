"""Rank 0's logger process: every row arrives in order, also past a full pipe and through the
signals a job step gets; a child that dies costs one warning, not the run; a child that cannot
start is one line."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from mshpc.config import load_config, to_dict
from mshpc.errors import RunEnvironmentError
from mshpc.events import append_event, read_jsonl
from mshpc.loggers.logger_process import LOST_EVENT, LoggerProcess, start_logger_process, tasks
from mshpc.loggers.sinks import build_loggers
from mshpc.run_dir import MetricsLog, read_metrics
from tests.support.waiting import wait_until

TB = ["run.loggers=[jsonl,tensorboard]"]


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_rows_arrive_in_order_past_a_full_pipe_and_through_signals(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
    cfg = load_config(None, TB)
    loggers = build_loggers(tmp_path, MetricsLog(tmp_path / "metrics.jsonl", 0), 0, run=cfg.run,
                            config_record=to_dict(cfg))
    child = loggers.others[0]
    assert isinstance(child, LoggerProcess)
    # The child is stopped while the rows are written, so the pipe surely fills whatever the
    # machine's load (a child that kept up left nothing pending); the signals reach it on SIGCONT.
    os.kill(child.proc.pid, signal.SIGSTOP)
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):  # what Slurm sends a job step
            os.kill(child.proc.pid, sig)
        most_pending = 0
        # 1.6 MB of rows: more than the pipe holds, so the loop keeps some itself without waiting
        for step in range(1, 1601):
            loggers.write({"step": step, "loss": 1.0 / step, "note": "x" * 1000})
            most_pending = max(most_pending, len(child.pending))
            if step == 800:
                append_event(tmp_path, "straggler", rank=1)
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
    loggers.close()
    assert most_pending > 0
    assert child.proc.returncode == 0
    assert scalars(tmp_path / "tb", "train/loss") == [(s, pytest.approx(1.0 / s)) for s in range(1, 1601)]
    assert [r["kind"] for r in read_jsonl(tmp_path / "events.jsonl")] == ["straggler"]


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_a_niced_logger_process_that_dies_costs_one_warning_not_the_run(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    cfg = load_config(None, TB)
    loggers = build_loggers(tmp_path, MetricsLog(tmp_path / "metrics.jsonl", 0), 0, run=cfg.run,
                            config_record=to_dict(cfg))
    child = loggers.others[0]
    assert isinstance(child, LoggerProcess)
    loggers.write({"step": 1, "loss": 1.0})  # TensorBoard's writer thread exists by now
    # once started, every thread of the child runs run.logger_nice_increment (10) lower; the loop not
    lowered = min(19, base + 10)
    wait_until(lambda: {os.getpriority(os.PRIO_PROCESS, t) for t in tasks(child.proc.pid)} == {lowered}, 60)
    assert len(tasks(child.proc.pid)) > 1 and os.getpriority(os.PRIO_PROCESS, 0) == base
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait()
    with caplog.at_level(logging.WARNING, logger="mshpc.loggers.logger_process"):
        for step in range(2, 11):
            loggers.write({"step": step, "loss": 1.0 / step})
        loggers.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "exited with code -9" in warned[0], warned
    lost = [r for r in read_jsonl(tmp_path / "events.jsonl") if r["kind"] == LOST_EVENT]
    assert len(lost) == 1 and "exited with code -9" in lost[0]["why"]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 11))


def test_a_logger_process_that_does_not_start_in_time_is_one_line(tmp_path: Path) -> None:
    cfg = load_config(None, TB)
    with pytest.raises(RunEnvironmentError, match=r"the logger process did not start within 0.01 s") as info:
        start_logger_process(tmp_path, 0, run=cfg.run, config_record=to_dict(cfg), timeout_s=0.01)  # an interpreter takes longer to start
    assert "\n" not in str(info.value)
