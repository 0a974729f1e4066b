"""Where a test may inject a fault into a run: the hook points the train loop, preflight and the
checkpoint saver call. Every hook here does nothing; a production run gets NO_FAULTS. The test
implementation (faults.py, driven by MSHPC_TEST_FAULTS) is built in one place, fault_setup.py,
so no product module imports it. A leaf: it imports nothing of mshpc."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


class FaultHooks:
    """No fault at any hook point. The collective failure needs no hook here: `at_step` arms it
    in faults.py by wrapping comm's one door for the next op, so a run with no fault never
    checks for one."""

    @property
    def gemm_slow_factor(self) -> int:
        """Preflight: each GEMM runs this many times and counts once (1: a healthy device)."""
        return 1

    @property
    def gemm_wrong(self) -> bool:
        """Preflight: whether one element of each GEMM result is made wrong."""
        return False

    def at_step(self, step: int) -> None:
        """The train loop, in the step phase of 0-based `step`, before its forward."""

    def before_write(self, step: int) -> None:
        """The saver, in the save of `step`, before this rank writes its shard: an OSError raised
        here is this rank's write error, reported to rank 0 like any other."""

    def before_commit(self, step: int) -> None:
        """The saver, once every shard of the save of `step` is written, before rank 0 commits."""

    def install_slowdown(self, model: nn.Module, start_step: int, forwards_per_step: int) -> None:
        """The train loop, once before its first step (resumed at `start_step`, `forwards_per_step`
        forwards of `model` per optimizer step)."""

    def before_restore(self, kept: list[torch.Tensor]) -> None:
        """The snapshot keeper, before a restore in place, with the buffers of the snapshots this
        rank keeps for another rank."""


NO_FAULTS = FaultHooks()
