"""What of the train state goes into a checkpoint, under which names, and how it comes back.

Names: `model/<param>` (whole, written by one rank per replica group), `optim.<key>/<param>`
(optimizer state, e.g. optim.exp_avg/layers.0.mlp.fc.weight), `rng/cpu/rank-<r>` and
`rng/cuda/rank-<r>` (each rank's generator). JSON-only state (step, scheduler, data position)
travels in the manifest's extras.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.tensor_slice import TensorSlice
from mshpc.parallel import comm


def model_slices(model: nn.Module) -> dict[str, TensorSlice]:
    return {f"model/{n}": TensorSlice.whole(p.detach()) for n, p in model.named_parameters()}


def optimizer_slices(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, TensorSlice]:
    """Every tensor of a (replicated, unsharded) optimizer's per-parameter state."""
    out = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{key}/{name}"] = TensorSlice.whole(value.detach())
    return out


def rng_slices(rank: int) -> dict[str, TensorSlice]:
    out = {f"rng/cpu/rank-{rank}": TensorSlice.whole(torch.get_rng_state())}
    if torch.cuda.is_available():
        out[f"rng/cuda/rank-{rank}"] = TensorSlice.whole(torch.cuda.get_rng_state())
    return out


def stage_rng(reader: CheckpointReader, rank: int, same_world: bool) -> dict[str, torch.Tensor]:
    """This rank's own generators. At another world size the ranks no longer correspond, so
    the generators keep their fresh seeding."""
    if not same_world:
        return {}
    names = [n for n in (f"rng/cpu/rank-{rank}", f"rng/cuda/rank-{rank}") if n in reader.names("rng/")]
    return {n: reader.read_whole(n) for n in names}


def apply_rng(staged: dict[str, torch.Tensor]) -> None:
    for name, state in staged.items():
        if name.startswith("rng/cpu/"):
            torch.set_rng_state(state)
        elif torch.cuda.is_available():
            torch.cuda.set_rng_state(state)


def stage_replicated(reader: CheckpointReader, names: list[str], is_reader: bool) -> dict[str, torch.Tensor]:
    """The reading rank loads and verifies every replicated tensor before anyone is changed, so
    a corrupt checkpoint is found while the live state is still intact."""
    return {n: reader.read_whole(n) for n in names} if is_reader else {}


def _broadcast_into(dest: torch.Tensor, staged: torch.Tensor | None, device: torch.device,
                    src: int, group: dist.ProcessGroup | None) -> None:
    # NCCL broadcasts device tensors only: CPU state (Adam's step) travels through the device.
    buf = (staged if staged is not None else torch.empty_like(dest)).to(device)
    comm.broadcast(buf, src=src, group=group)
    dest.copy_(buf.reshape(dest.shape))


def apply_model(model: nn.Module, staged: dict[str, torch.Tensor], device: torch.device,
                src: int, group: dist.ProcessGroup | None) -> None:
    """Collective over the replica group: `src` sends every parameter it staged (MegaScale's
    restore: one read per replica group, then a broadcast)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            _broadcast_into(p.data, staged.get(f"model/{name}"), device, src, group)


def apply_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, reader: CheckpointReader,
                    staged: dict[str, torch.Tensor], device: torch.device, src: int,
                    group: dist.ProcessGroup | None) -> None:
    """Collective over the replica group: rebuild each parameter's optimizer state from `src`."""
    params = dict(model.named_parameters())
    for name in reader.names("optim."):
        head, _, pname = name.partition("/")
        p, shape = params[pname], reader.global_shape(name)
        # Adam-style step counters live on the CPU; moments live with their parameter.
        where = torch.device("cpu") if shape == () else p.device
        dest = torch.empty(shape, dtype=reader.dtype(name), device=where)
        _broadcast_into(dest, staged.get(name), device, src, group)
        optimizer.state[p][head.removeprefix("optim.")] = dest
