"""Rank 0's console: the progress of each step (a bar redrawn in place on a terminal, plain
lines elsewhere), a line of its own for each validation and each new data epoch, and one summary
at the end; what torchtitan's and Megatron's logs show a user.

On a terminal the bar is the line being redrawn, so any log record would be written onto it: a
filter on the root logger's handlers wipes the bar before each record, and the next step redraws it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

BAR_WIDTH = 24
CLEAR_LINE = "\r\033[K"  # back to the line's start, then erase it (ECMA-48 EL)


def clock(seconds: float) -> str:
    """1:02:03, or 2:03 under an hour."""
    s = max(int(round(seconds)), 0)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


@dataclass
class RunTally:
    """What the end-of-run summary reports, gathered as the steps go."""

    first_step: int  # 0-based step this process started at (a resume's checkpoint)
    steps: int = 0
    last_loss: float | None = None
    val: list[tuple[int, float]] = field(default_factory=list)  # (step, val_loss)

    def best_val(self) -> tuple[int, float] | None:
        return min(self.val, key=lambda sv: sv[1]) if self.val else None


class _WipeBar(logging.Filter):
    """Wipes the progress bar off the terminal before a log record is written (never drops one)."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def filter(self, record: logging.LogRecord) -> bool:
        self.progress.wipe()
        return True


class Progress:
    def __init__(self, total_steps: int, mode: str, stream: TextIO | None = None, start_step: int = 0,
                 windows_per_epoch: int | None = None, global_batch: int = 1,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.total = total_steps
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self.now, self.started = now, now()
        self.tally = RunTally(first_step=start_step)
        self._windows, self._global_batch = windows_per_epoch, global_batch
        self._first_done_at: float | None = None  # after the first step (compile, warm-up): the ETA's origin
        self._bar_shown = False
        self._filter = _WipeBar(self)
        if self.mode == "bar":
            for handler in logging.getLogger().handlers:
                handler.addFilter(self._filter)

    def update(self, done: int, loss: float, tokens_per_s: float, mfu: float | None, lr: float | None = None) -> None:
        """Show the state once `done` steps are done."""
        self.tally.steps += 1
        self.tally.last_loss = loss
        if self.mode == "none":
            return
        now = self.now()
        text = f"step {done}/{self.total} loss {loss:.4f}"
        if lr is not None:
            text += f" lr {lr:.2e}"
        text += f" {tokens_per_s:,.0f} tok/s"
        if mfu is not None:
            text += f" mfu {100 * mfu:.1f}%"
        text += f" elapsed {clock(now - self.started)}"
        eta = self._eta(done, now)
        if eta is not None:
            text += f" eta {clock(eta)}"
        if self.mode == "bar":
            filled = BAR_WIDTH * done // self.total
            self.stream.write(f"{CLEAR_LINE}[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {text}")
            self._bar_shown = done != self.total
            if done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._epoch_notice(done)

    def _eta(self, done: int, now: float) -> float | None:
        """Seconds left at the pace since the first step (which compiles and warms up)."""
        if self._first_done_at is None:
            self._first_done_at, self._first_done = now, done
            return None
        if done >= self.total or done <= self._first_done:
            return 0.0 if done >= self.total else None
        return (now - self._first_done_at) / (done - self._first_done) * (self.total - done)

    def validation(self, done: int, row: dict[str, float]) -> None:
        """A validation's line of its own, once `done` steps are done."""
        self.tally.val.append((done, row["val_loss"]))
        self.line(f"step {done}/{self.total} val_loss {row['val_loss']:.4f} val_ppl {row['val_ppl']:.2f} "
                  f"({row['eval_s']:.1f} s)")

    def _epoch_notice(self, done: int) -> None:
        """When the step that made it `done` steps read into a new pass over the training windows
        (the sampler takes global_batch windows a step, in a new order each epoch)."""
        n, gb = self._windows, self._global_batch
        if not n:
            return
        epoch, before = (done * gb - 1) // n, ((done - 1) * gb - 1) // n if done > 1 else 0
        if epoch > before:
            self.line(f"data: epoch {epoch + 1} began at step {done} (every one of the {n:,} training "
                      f"windows read {epoch} time{'s' if epoch > 1 else ''}; now in a new order)")

    def line(self, text: str) -> None:
        """A line of its own (never glued to the bar)."""
        if self.mode == "none":
            return
        self.wipe()
        self.stream.write(text + "\n")
        self.stream.flush()

    def wipe(self) -> None:
        """Take the bar off the terminal's current line; the next update draws it again."""
        if self._bar_shown:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
            self._bar_shown = False

    def close(self) -> None:
        self.wipe()
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self._filter)

    def elapsed_s(self) -> float:
        return self.now() - self.started


@dataclass(frozen=True)
class Kept:
    """The checkpoints a run leaves: their folder, the newest step and how many."""

    root: Path
    latest: int | None
    count: int


def summary_lines(tally: RunTally, total_steps: int, elapsed_s: float, tokens_per_step: int, run_dir: Path,
                  kept: Kept | None) -> list[str]:
    """The end-of-run summary: steps, tokens, time, losses, checkpoints, where the report is."""
    tokens = tally.steps * tokens_per_step
    rate = f" ({tokens / elapsed_s:,.0f} tok/s)" if elapsed_s > 0 else ""
    first, last = tally.first_step + 1, tally.first_step + tally.steps
    span = f"steps {first}-{last} of {total_steps}" if tally.steps else f"no step (resumed at {tally.first_step})"
    loss = f"; last loss {tally.last_loss:.4f}" if tally.last_loss is not None else ""
    lines = [f"finished {span}: {tokens:,} tokens in {clock(elapsed_s)}{rate}{loss}"]
    best = tally.best_val()
    if best is not None:
        lines.append(f"validation: best val_loss {best[1]:.4f} at step {best[0]}, last {tally.val[-1][1]:.4f} "
                     f"at step {tally.val[-1][0]}")
    if kept is None or kept.latest is None:
        lines.append("checkpoints: none (checkpoint.interval_steps=0)")
    else:
        lines.append(f"checkpoints: {kept.root} (latest step {kept.latest}, {kept.count} kept)")
    lines.append(f"run directory: {run_dir} (metrics.jsonl, events.jsonl); report: `mshpc diagnose {run_dir}` "
                 f"writes {run_dir / 'report' / 'index.html'}")
    return lines
