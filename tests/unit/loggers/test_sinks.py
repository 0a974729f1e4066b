"""The loggers' fan-out: every row to every logger, events handed on once each across attempts,
and a logger that cannot start is one line at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mshpc.config import load_config, to_dict
from mshpc.errors import RunEnvironmentError
from mshpc.events import append_event, read_jsonl
from mshpc.loggers.sinks import EventTail, Loggers, build_loggers
from mshpc.run_dir import MetricsLog, read_metrics

REPO = Path(__file__).resolve().parents[3]


class Recorder:
    """A logger that keeps what it is given (the interface's simplest implementation)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.events: list[tuple[str, int]] = []

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def event(self, record: dict[str, Any], step: int) -> None:
        self.events.append((record["kind"], step))

    def close(self) -> None:
        pass


def test_rows_reach_every_logger_and_events_are_handed_on_once(tmp_path: Path) -> None:
    append_event(tmp_path, "supervisor_start")
    rec = Recorder()
    loggers = Loggers(MetricsLog(tmp_path / "metrics.jsonl", 0), [rec], EventTail(tmp_path))
    loggers.write({"step": 1, "loss": 5.0})
    append_event(tmp_path, "straggler", rank=1)
    loggers.write({"step": 2, "loss": 4.0})
    loggers.close()
    assert rec.rows == [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}]
    assert read_metrics(tmp_path / "metrics.jsonl") == rec.rows
    assert rec.events == [("supervisor_start", 1), ("straggler", 2)]
    # the next attempt hands on what the supervisor wrote in between, and nothing again
    append_event(tmp_path, "failure_detected")
    append_event(tmp_path, "restart")
    again = Recorder()
    loggers = Loggers(MetricsLog(tmp_path / "metrics.jsonl", 2), [again], EventTail(tmp_path))
    loggers.write({"step": 3, "loss": 3.0})
    loggers.close()
    assert again.events == [("failure_detected", 3), ("restart", 3)]


def test_a_line_still_being_written_waits(tmp_path: Path) -> None:
    append_event(tmp_path, "resumed")
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('{"kind": "strag')  # the writer's next write() finishes it
    tail = EventTail(tmp_path)
    assert [r["kind"] for r in tail.new()] == ["resumed"]
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('gler"}\n')
    assert [r["kind"] for r in tail.new()] == ["straggler"]


def test_unwritable_tensorboard_folder_is_one_line_at_start(tmp_path: Path) -> None:
    (tmp_path / "tb").write_text("a file where the folder goes")
    cfg = load_config(None, ["run.loggers=[jsonl,tensorboard]"])
    metrics = MetricsLog(tmp_path / "metrics.jsonl", 0)
    with pytest.raises(RunEnvironmentError, match=r"run.loggers 'tensorboard': cannot write .*tb") as info:
        build_loggers(tmp_path, metrics, 0, run=cfg.run, config_record=to_dict(cfg))
    assert "\n" not in str(info.value)


def test_missing_package_names_the_install_command(tmp_path: Path) -> None:
    # a sitecustomize that makes the packages unimportable, as where they are not installed: it
    # reaches the logger process too, which inherits PYTHONPATH
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys; sys.modules['torch.utils.tensorboard'] = None; sys.modules['wandb'] = None\n")
    code = (
        "from pathlib import Path\n"
        "from mshpc.config import load_config, to_dict\nfrom mshpc.errors import ConfigError\n"
        "from mshpc.loggers.sinks import build_loggers\nfrom mshpc.run_dir import MetricsLog\n"
        f"tmp = Path({str(tmp_path)!r})\n"
        "for name in ('tensorboard', 'wandb'):\n"
        "    try:\n"
        "        cfg = load_config(None, [f'run.loggers=[jsonl,{name}]'])\n"
        "        build_loggers(tmp, MetricsLog(tmp / 'm.jsonl', 0), 0, run=cfg.run, config_record=to_dict(cfg))\n"
        "    except ConfigError as exc:\n"
        "        print(exc)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        "run.loggers names 'tensorboard' but the tensorboard package is not installed: "
        "pip install 'mshpc[tensorboard]' (or pip install tensorboard)",
        "run.loggers names 'wandb' but the wandb package is not installed: pip install 'mshpc[wandb]' "
        "(or pip install wandb)",
    ]
