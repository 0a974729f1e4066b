"""W&B offline: with WANDB_MODE=offline (and here, no network at all) the logger writes its run
folder under the run directory and never waits on a server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mshpc.config import load_config, to_dict
from mshpc.loggers.wandb_log import WandbLogger, reachable


def test_offline_run_folder_holds_the_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="the test extra installs wandb")
    for var, folder in (("WANDB_DIR", "wandb-dir"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                        ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / folder))
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config(None, ["run.loggers=[jsonl,wandb]", "run.name=w"])
    start = time.perf_counter()
    logger = WandbLogger(tmp_path, 0, run=cfg.run, config_record=to_dict(cfg))
    for step in (1, 2, 3):
        logger.write({"step": step, "loss": 5.0 - step, "val_loss": None, "mfu": float("nan")})
    logger.event({"kind": "straggler", "rank": 1, "time": 0.0}, 3)
    logger.write({"step": 4, "loss": 1.0, "val_loss": 1.5})
    logger.close()
    elapsed = time.perf_counter() - start
    runs = list((tmp_path / "wandb").glob("offline-run-*-w-*"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))[:20]
    data = list(runs[0].glob("run-*.wandb"))
    assert len(data) == 1
    # wandb's binary log holds each history key as plain protobuf text (its reader is in Go)
    written = data[0].read_bytes()
    for key in (b"train/loss", b"val/loss", b"events/straggler", b"events/text"):
        assert key in written, key
    assert b"perf/mfu" not in written  # NaN and None are not numbers to plot
    assert elapsed < 60  # no network wait: a server that never answers would hold init much longer


def test_probe_gives_up_quickly_on_an_unanswering_address() -> None:
    start = time.perf_counter()
    assert not reachable(("192.0.2.1", 443), timeout_s=0.5)  # TEST-NET-1: routed nowhere
    assert time.perf_counter() - start < 2.0
