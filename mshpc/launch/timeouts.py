"""Per-phase hang timeouts, calibrated from the durations the ranks observed.

A phase hangs when it lasts longer than max(floor, k x its median so far): k x the median
adapts to the model and machine (a 175B step and a CPU test step differ by 1000x), and the
floor keeps noise on a fast phase from looking like a hang. The checkpoint, eval and compile
(train.compile's first step) phases have their own, larger floor, so a long save, validation or
compilation is not a hang; start-up has a fixed limit (nothing to calibrate on).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mshpc.config import SupervisorConfig
from mshpc.phases import LONG, SETUP


@dataclass(frozen=True)
class PhaseTimeout:
    seconds: float
    why: str  # how it was chosen, for the events and the hang report


def phase_timeout(cfg: SupervisorConfig, phase: str, medians: Iterable[float]) -> PhaseTimeout:
    """The timeout of `phase`, given the ranks' median durations of it (the slowest rank's counts)."""
    if phase == SETUP:
        return PhaseTimeout(cfg.setup_timeout_s, f"supervisor.setup_timeout_s={cfg.setup_timeout_s:g}")
    # validation (every eval.interval_steps) and compilation (train.compile's first step, minutes
    # on a loaded CPU) are long and rare like a save: the same floor
    long = phase in LONG
    floor = cfg.checkpoint_timeout_s if long else cfg.timeout_floor_s
    floor_name = "checkpoint_timeout_s" if long else "timeout_floor_s"
    median = max(medians, default=None)
    if median is None or cfg.timeout_k * median <= floor:
        seen = "" if median is None else f" > {cfg.timeout_k:g} x median {median:.3g} s"
        return PhaseTimeout(floor, f"supervisor.{floor_name}={floor:g}{seen}")
    return PhaseTimeout(cfg.timeout_k * median, f"{cfg.timeout_k:g} x median {median:.3g} s > "
                        f"supervisor.{floor_name}={floor:g}")
