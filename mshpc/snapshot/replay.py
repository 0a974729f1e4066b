"""Replay of suspicious steps (`recovery.replay`): a step whose loss or gradient norm is NaN/Inf,
or past `recovery.spike_factor` times its running median, is run again from the snapshot taken
before it, on the same ranks and the same batch, and the two runs are compared.

  reproducible  both runs agree on every rank: the data or the model did it. Training goes on
                with the result, and a NaN or a loss past `supervisor.loss_limit` ends the run as
                before (mshpc/loss_check.py), for the supervisor to handle.
  transient     some rank computed something else the second time: a fault that did not repeat.
                Training goes on from the replay, which is what an undisturbed run computes.
  persistent    the same rank differed in `recovery.persistent_after` replays: its device keeps
                corrupting data silently, and its node is evicted (SilentDataCorruption).

Attribution needs each rank's own contribution, before the collectives mix them: a fingerprint
of its local gradients (the sum of their squares, summed in each parameter's hook), which a
corrupted forward on that rank changes too. Megatron's rerun state machine reruns on the same GPU too, then on another one to tell a
persistent fault from a true result; here the fingerprints name the rank at once, and repetition
across replays is what makes a fault persistent.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StepResult:
    """What one run of a step produced, on this rank: the global loss and gradient norm (the same
    on every rank) and the fingerprint of this rank's own gradients."""

    loss: float
    grad_norm: float
    local_grad_sq: float

    def as_json(self) -> list[str]:
        # JSON has no NaN or Inf literal; repr() round-trips every float exactly
        return [repr(v) for v in (self.loss, self.grad_norm, self.local_grad_sq)]

    @staticmethod
    def from_json(values: list[str]) -> StepResult:
        return StepResult(*(float(v) for v in values))


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


class SpikeWatch:
    """The running medians of the loss and of the gradient norm over the last `window` accepted
    steps; a step is suspicious when either is not finite or exceeds `factor` times its median."""

    def __init__(self, factor: float, window: int) -> None:
        self.factor = factor
        self._loss: collections.deque[float] = collections.deque(maxlen=window)
        self._norm: collections.deque[float] = collections.deque(maxlen=window)

    def suspicious(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is suspicious, or None. Identical on every rank: both values are global."""
        for name, value, history in (("loss", loss, self._loss), ("gradient norm", grad_norm, self._norm)):
            if not math.isfinite(value):
                return f"{name} {value}"
            if len(history) >= 3 and value > self.factor * (median := statistics.median(history)):
                return f"{name} {value:.4g} > {self.factor:g} x its running median {median:.4g}"
        return None

    def accept(self, loss: float, grad_norm: float) -> None:
        """Count a step that training keeps."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self._loss.append(loss)
            self._norm.append(grad_norm)


class GradFingerprint:
    """The sum of squares of every local gradient this rank computes in a step, accumulated on
    the device in each parameter's hook (no synchronisation), read once when a step is replayed."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self._sum = torch.zeros((), dtype=torch.float64, device=device)
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(self._add)

    def _add(self, grad: torch.Tensor) -> None:
        self._sum += grad.detach().float().square().sum()

    def take(self) -> float:
        """The step's fingerprint; it starts again from zero."""
        value = float(self._sum)
        self._sum.zero_()
        return value

    def reset(self) -> None:
        self._sum.zero_()


@dataclass(frozen=True)
class Verdict:
    kind: str  # "reproducible", "transient" or "persistent"
    ranks: tuple[int, ...]  # the ranks whose own results differed between the runs
    differed: dict[str, str]  # what differed, in words, by rank (and "global")


def compare(first: list[StepResult], second: list[StepResult]) -> tuple[tuple[int, ...], dict[str, str]]:
    """The ranks whose local results differ between the two runs, and what differed."""
    ranks, differed = [], {}
    for rank, (a, b) in enumerate(zip(first, second, strict=True)):
        if not _same(a.local_grad_sq, b.local_grad_sq):
            ranks.append(rank)
            differed[f"rank {rank}"] = f"local gradient sum of squares {a.local_grad_sq!r} then {b.local_grad_sq!r}"
    a, b = first[0], second[0]
    glob = [f"{name} {x!r} then {y!r}" for name, x, y in (("loss", a.loss, b.loss), ("gradient norm", a.grad_norm, b.grad_norm))
            if not _same(x, y)]
    if glob:
        differed["global"] = "; ".join(glob)
    return tuple(ranks), differed


class ReplayLedger:
    """How often each rank has differed from its own replay; at `persistent_after` it is persistent."""

    def __init__(self, persistent_after: int) -> None:
        self.persistent_after = persistent_after
        self.counts: collections.Counter[int] = collections.Counter()

    def judge(self, first: list[StepResult], second: list[StepResult]) -> Verdict:
        ranks, differed = compare(first, second)
        if not differed:
            return Verdict("reproducible", (), {})
        self.counts.update(ranks)
        if any(self.counts[r] >= self.persistent_after for r in ranks):
            return Verdict("persistent", tuple(r for r in ranks if self.counts[r] >= self.persistent_after), differed)
        return Verdict("transient", ranks, differed)
