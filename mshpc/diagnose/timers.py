"""Always-on phase timers (MegaScale, Jiang et al. 2024, sec. 5.1).

A phase is a named span on the train loop's thread: `with phase(FORWARD): ...` (mshpc/phases.py). Phases nest,
and each one keeps its own ("self") time, without the phases inside it, so the phases of a step
add up to the step: the optimizer's time excludes the collectives it waits for, and whatever no
phase covers is the step's "other".

Two clocks, chosen once per run. On GPU a mark is a CUDA event recorded on the current stream and
read by the collector's thread once it has completed, a step or more later: the timer never
synchronises the device, and a phase measures device time (a host-side wait, such as waiting for
data, shows only as far as it left the device idle). On CPU a mark is a perf_counter() reading.

Only the thread that began the step is timed: the checkpoint saver's thread and autograd's device
threads issue work that overlaps the loop by design and would be counted twice.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from mshpc.phases import CHECKPOINT, DATA, EVAL, OTHER

# The loop's phase names are mshpc/phases.py's; collectives are "comm.<op>" (mshpc/parallel/comm.py).
COMM_PREFIX = "comm."
PIPELINE_PREFIX = "pipeline."
# Point-to-point waits are where a pipeline stage idles for its neighbour: the bubble.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
# "eval" (validation, every eval.interval_steps) is its own: no rank is blamed for it
CATEGORIES = ("compute", "communication", "data wait", "bubble", "checkpoint", "eval", "other")


@functools.cache  # a handful of names, asked for every step and rank
def category(phase: str) -> str:
    """The breakdown a phase counts in; a phase nobody declared (a layer's own timer) is compute."""
    if phase.startswith(COMM_PREFIX):
        return "bubble" if phase[len(COMM_PREFIX):] in P2P_OPS else "communication"
    if phase.startswith(PIPELINE_PREFIX):
        return "bubble"
    return {DATA: "data wait", CHECKPOINT: "checkpoint", EVAL: "eval", OTHER: "other"}.get(phase, "compute")


class CpuClock:
    name = "cpu"

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, marks: list[Any]) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def release(self, marks: list[Any]) -> None:
        pass


class CudaClock:
    """CUDA events from a free list (creating one per mark would cost an allocation each);
    the collector's thread hands them back once read."""

    name = "cuda"

    def __init__(self) -> None:
        self._free: collections.deque[torch.cuda.Event] = collections.deque()

    def mark(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, marks: list[torch.cuda.Event]) -> bool:
        return all(e.query() for e in marks)  # query() never blocks

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def release(self, marks: list[torch.cuda.Event]) -> None:
        self._free.extend(marks)


Clock = CpuClock | CudaClock


@dataclass
class StepSpans:
    """One step's spans as marks, read later: (name, parent index, start, end); span 0 is the step."""

    step: int
    spans: list[list[Any]]
    clock: Clock

    def marks(self) -> list[Any]:
        return [m for s in self.spans for m in s[2:]]

    def ready(self) -> bool:
        return self.clock.ready(self.marks())

    def resolve(self) -> tuple[float, dict[str, float]]:
        """(step seconds, {phase: self seconds}); call once ready(). Returns the marks to the clock."""
        durations = [self.clock.seconds(start, end) for _, _, start, end in self.spans]
        own = list(durations)
        for (_, parent, _, _), seconds in zip(self.spans, durations, strict=True):
            if parent >= 0:
                own[parent] -= seconds
        phases: dict[str, float] = {}
        for (name, _, _, _), seconds in zip(self.spans[1:], own[1:], strict=True):
            phases[name] = phases.get(name, 0.0) + max(seconds, 0.0)
        phases[OTHER] = max(own[0], 0.0)  # device clocks of several streams may overlap a little
        self.clock.release(self.marks())
        return durations[0], phases


class PhaseTimers:
    """This process's phase timers: off until `configure`; a step is begin_step ... end_step."""

    def __init__(self) -> None:
        self.enabled = False
        self._clock: Clock = CpuClock()
        self._owner: int | None = None
        self._step = 0
        self._spans: list[list[Any]] = []
        self._stack: list[int] = []

    def configure(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self._clock = CudaClock() if device.type == "cuda" else CpuClock()
        self._stack = []

    @property
    def clock_name(self) -> str:
        return self._clock.name

    def begin_step(self, step: int) -> None:
        if not self.enabled:
            return
        self._owner, self._step = threading.get_ident(), step
        self._spans = [["step", -1, self._clock.mark(), None]]
        self._stack = [0]

    def end_step(self) -> StepSpans | None:
        """Close the step; its spans, to be read when ready (None when timers are off)."""
        if not self._stack:
            return None
        for span in self._spans[1:]:
            if span[3] is None:  # left open by an exception: it ends with the step
                span[3] = self._clock.mark()
        self._spans[0][3] = self._clock.mark()
        spans, self._spans, self._stack = self._spans, [], []
        return StepSpans(self._step, spans, self._clock)

    def phase(self, name: str) -> _Phase:
        """Time the `with` block as phase `name` (a no-op outside a step or off its thread)."""
        return _Phase(self, name)

    def _open(self, name: str) -> int:
        self._spans.append([name, self._stack[-1], self._clock.mark(), None])
        self._stack.append(len(self._spans) - 1)
        return self._stack[-1]

    def _close(self, index: int) -> None:
        self._spans[index][3] = self._clock.mark()
        # an exception may have skipped inner closes: unwind to this span
        while self._stack and self._stack.pop() != index:
            pass


class _Phase:
    __slots__ = ("_timers", "_name", "_index")

    def __init__(self, timers: PhaseTimers, name: str) -> None:
        self._timers, self._name, self._index = timers, name, -1

    def __enter__(self) -> None:
        t = self._timers
        if t._stack and threading.get_ident() == t._owner:
            self._index = t._open(self._name)

    def __exit__(self, *exc: object) -> None:
        if self._index >= 0 and self._timers._stack:
            self._timers._close(self._index)


# One per process by nature, like comm.RECORDER: it describes the work of this process.
TIMERS = PhaseTimers()


def phase(name: str) -> _Phase:
    """`with phase(FORWARD): ...` times the block as a phase of the current step."""
    return TIMERS.phase(name)
