"""TensorBoard: event files under <run dir>/tb/, written through torch.utils.tensorboard."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from mshpc.errors import ConfigError, RunEnvironmentError
from mshpc.loggers.sinks import describe

INSTALL = "pip install 'mshpc[tensorboard]' (or pip install tensorboard)"

# The row's keys by the TensorBoard section they are shown in; a key not named here is "train/".
SECTIONS = {
    "val_loss": "val/loss", "val_ppl": "val/ppl", "eval_s": "val/eval_s",
    "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
    "tflops": "perf/tflops", "data_wait_s": "perf/data_wait_s", "max_memory_gib": "perf/max_memory_gib",
    "ckpt_blocking_s": "checkpoint/blocking_s", "ckpt_stage1_wait_s": "checkpoint/stage1_wait_s",
}


def tag(key: str) -> str:
    """The scalar's TensorBoard tag: the row key, grouped into a section."""
    return SECTIONS.get(key, f"train/{key}")


class TensorBoardLogger:
    """Scalars for every number of a row; events as text under "events" (the step they arrived at)."""

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(f"run.loggers names 'tensorboard' but the tensorboard package is not "
                              f"installed: {INSTALL}") from None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            # flush_secs: what a crash loses; the writer's own thread writes, not the train loop
            self.writer = SummaryWriter(log_dir=str(folder), flush_secs=10)
        except OSError as exc:
            raise RunEnvironmentError(f"run.loggers 'tensorboard': cannot write {folder} ({exc.strerror}); "
                                      "choose a writable run.out_dir") from None

    def write(self, row: dict[str, Any]) -> None:
        step = row["step"]
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self.writer.add_scalar(tag(key), value, step)
            elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                # a list of numbers (a MoE layer's tokens per expert): their spread, as a histogram
                self.writer.add_histogram(tag(key), torch.tensor(value, dtype=torch.float64), step)

    def event(self, record: dict[str, Any], step: int) -> None:
        self.writer.add_text("events", describe(record), step)

    def close(self) -> None:
        self.writer.close()
