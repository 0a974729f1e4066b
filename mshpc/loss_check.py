"""The loss check: a diverged loss stops training before the step that produced it is saved."""

from __future__ import annotations

import math


class LossDiverged(RuntimeError):
    """The global loss is NaN/Inf or above supervisor.loss_limit: raised on every rank alike
    (the loss is all-reduced), before the step can be checkpointed."""


def check_loss(loss: float, step: int, limit: float | None) -> None:
    """Raise LossDiverged when the global `loss` of `step` (0-based) is NaN/Inf or above `limit`."""
    if not math.isfinite(loss) or (limit is not None and loss > limit):
        raise LossDiverged(f"loss {loss} at step {step + 1} (NaN/Inf, or above supervisor.loss_limit={limit})")


class StateDiverged(LossDiverged):
    """Weights or optimizer state hold NaN/Inf when a checkpoint is taken (a step whose loss was
    still finite diverged in its update): that save is refused, and like a diverged loss the run
    goes back to the last checkpoint, which holds none (one that does is refused on resume)."""
