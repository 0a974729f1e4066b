"""Rank 0's progress display: a bar redrawn in place on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
from typing import TextIO

BAR_WIDTH = 24


class Progress:
    def __init__(self, total_steps: int, mode: str, stream: TextIO | None = None) -> None:
        self.total = total_steps
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode

    def update(self, done: int, loss: float, tokens_per_s: float, mfu: float | None) -> None:
        """Show the state once `done` steps are done."""
        if self.mode == "none":
            return
        text = f"step {done}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s"
        if mfu is not None:
            text += f" mfu {100 * mfu:.1f}%"
        if self.mode == "bar":
            filled = BAR_WIDTH * done // self.total
            self.stream.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {text}")
            if done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
