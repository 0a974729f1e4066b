"""`mshpc prepare`'s progress: a bar redrawn in place on a terminal (documents, MB/s, ETA), plain
lines every LINE_INTERVAL_S elsewhere (a log file, a batch job), and a last line either way."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24
LINE_INTERVAL_S = 10.0
REDRAW_S = 0.2


class PrepareProgress:
    """Counts documents and input bytes against the corpus's total bytes."""

    def __init__(self, total_bytes: int, stream: TextIO | None = None, mode: str = "auto") -> None:
        self.total = max(total_bytes, 1)
        self.stream = stream or sys.stderr
        self.mode = ("bar" if self.stream.isatty() else "lines") if mode == "auto" else mode
        self.docs = self.bytes = 0
        self._start = self._shown = time.monotonic()

    def _text(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = self.bytes / elapsed
        left = (self.total - self.bytes) / rate if rate > 0 and self.bytes < self.total else 0.0
        share = min(self.bytes / self.total, 1.0)
        return (f"{self.docs:,} docs, {self.bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB ({100 * share:.0f}%), "
                f"{rate / 1e6:.2f} MB/s, ETA {left:.0f} s")

    def update(self, docs: int, input_bytes: int) -> None:
        self.docs += docs
        self.bytes += input_bytes
        now = time.monotonic()
        if self.mode == "bar" and now - self._shown >= REDRAW_S:
            filled = int(BAR_WIDTH * min(self.bytes / self.total, 1.0))
            self.stream.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self._text(now)}")
        elif self.mode == "lines" and now - self._shown >= LINE_INTERVAL_S:
            self.stream.write(f"mshpc: prepare: {self._text(now)}\n")
        else:
            return
        self._shown = now
        self.stream.flush()

    def close(self) -> None:
        """The final figures, on a line of their own."""
        if self.mode == "none":
            return
        elapsed = time.monotonic() - self._start
        end = "\r" if self.mode == "bar" else ""
        self.stream.write(f"{end}mshpc: prepare: {self.docs:,} docs, {self.bytes / 1e6:,.1f} MB in {elapsed:.1f} s "
                          f"({self.bytes / 1e6 / max(elapsed, 1e-9):.2f} MB/s)\n")
        self.stream.flush()
