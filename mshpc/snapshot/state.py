"""What a snapshot holds of a rank, and how it is put back: the rank's ZeRO shard (every piece's
fp32 master and optimizer moments, and the optimizer's step counter), the model's persistent
buffers (a router's expert biases: state that trains but is no parameter), its random generators,
and as JSON the step, the data position and the learning-rate schedule. The same names as a disk
checkpoint's (`master/<key>`, `optim.<state>/<key>`, `optim.step`), so the engine installs a
snapshot through the reader interface it restores checkpoints through.

Unlike a checkpoint, a snapshot holds every piece of the rank, also the tp-replicated ones tp rank
0 alone saves to disk: a snapshot restores this one rank (or its replacement) by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mshpc.checkpoint.state import persistent_buffers
from mshpc.parallel.sharded_optim import STATE_KEYS
from mshpc.parallel.zero import ZeroEngine

RNG_CPU, RNG_CUDA = "rng/cpu", "rng/cuda"


@dataclass(frozen=True)
class TrainState:
    """What the train loop owns besides the engine and a snapshot restores: the scheduler."""

    engine: ZeroEngine
    scheduler: torch.optim.lr_scheduler.LRScheduler


def live_tensors(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """The live state tensors of this rank's shard, in a fixed order, looked up anew on each
    call (an optimizer may replace a state tensor), plus its generators as they are now."""
    out: dict[str, torch.Tensor] = {}
    for piece in engine.pieces:
        out[f"master/{piece.key}"] = piece.tensor
        state = engine.optimizer.state[piece.tensor]
        for key in STATE_KEYS:
            out[f"optim.{key}/{piece.key}"] = state[key]
    if engine.pieces:  # every piece's counter is the same: the checkpoint keeps one too
        out["optim.step"] = engine.optimizer.state[engine.pieces[0].tensor]["step"].reshape(1)
    for name, buffer in persistent_buffers(engine.model).items():
        out[f"buffer/{name}"] = buffer
    out[RNG_CPU] = torch.get_rng_state()
    if torch.cuda.is_available():
        out[RNG_CUDA] = torch.cuda.get_rng_state()
    return out


def extras(step: int, state: TrainState) -> dict[str, Any]:
    """The JSON part: the step (which is also the data position: the sampler's order is a
    function of the step alone), the schedule and each group's learning rate."""
    groups = state.engine.optimizer.param_groups
    return {"step": step, "scheduler": state.scheduler.state_dict(), "group_lrs": [g["lr"] for g in groups]}


def install(tensors: dict[str, torch.Tensor], info: dict[str, Any], state: TrainState) -> None:
    """Put a snapshot's tensors and extras back into the engine, the generators and the
    scheduler. Collective over the engine's dp group (the weights are gathered again)."""

    def read(name: str, start: int, numel: int) -> torch.Tensor:
        t = tensors[name].reshape(-1)
        assert t.numel() == numel, (name, t.numel(), numel)  # a snapshot is this rank's own shard
        return t

    state.engine.load_state_slices(read)
    with torch.no_grad():
        for name, buffer in persistent_buffers(state.engine.model).items():
            buffer.copy_(tensors[f"buffer/{name}"])
    torch.set_rng_state(tensors[RNG_CPU].clone())
    if RNG_CUDA in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors[RNG_CUDA].clone())
    state.scheduler.load_state_dict(info["scheduler"])
    for group, lr in zip(state.engine.optimizer.param_groups, info["group_lrs"], strict=True):
        group["lr"] = lr
