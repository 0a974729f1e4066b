"""Which steps end in a checkpoint save: one rule, read by the checkpointer (to save) and by the
heartbeat (a save's phase is not a hang). Torch-free and above neither, so the launch and the
checkpoint layers both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from mshpc.config import CheckpointConfig, TrainConfig


@dataclass(frozen=True)
class SaveSchedule:
    interval_steps: int  # checkpoint.interval_steps; 0 turns saving off
    last_step: int  # train.steps: the end always saves, whatever the interval

    @classmethod
    def of(cls, *, checkpoint: CheckpointConfig, train: TrainConfig) -> SaveSchedule:
        return cls(checkpoint.interval_steps, train.steps)

    def due(self, step: int) -> bool:
        """Whether a save follows `step`, the count of optimizer steps done (1-based)."""
        return self.interval_steps > 0 and (step % self.interval_steps == 0 or step == self.last_step)
