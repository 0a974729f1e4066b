"""The CLI's one-line error reaches stderr in one write: under mpiexec every rank's stderr is
forwarded by chunks, and a line written in two pieces can run into another rank's line."""

import io
import sys

from mshpc.errors import RunEnvironmentError, print_error


class _Recording(io.RawIOBase):
    """A raw stream that keeps each write as the OS would see it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self.writes.append(bytes(b))
        return len(b)


def test_the_error_line_is_a_single_write_ending_in_its_newline(monkeypatch):
    raw = _Recording()
    # How CPython sets up sys.stderr: text written through to an unbuffered file, so print()'s
    # text and its newline are two writes (the old code's bug).
    stream = io.TextIOWrapper(raw, write_through=True)
    monkeypatch.setattr(sys, "stderr", stream)
    print_error(RunEnvironmentError("cannot write /x: no space left"))
    assert raw.writes == [b"mshpc: error: RunEnvironmentError: cannot write /x: no space left\n"]
