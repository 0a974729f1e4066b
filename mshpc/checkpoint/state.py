"""What of the train state goes into a checkpoint besides the ZeRO engine's own slices.

Names: `model/<param>` (the dp-replicated weights, each whole in one dp rank's shard, spread
over the dp ranks by bytes; under tensor parallelism a tp shard is `model/<param>@tp<r>`, a
tp-replicated weight comes from tp rank 0),
`rng/cpu/rank-<r>` and `rng/cuda/rank-<r>` (each rank's generator), `buffer/<name>` (state that
is no parameter yet trains: a sigmoid-bias router's expert biases, the same on every rank, saved
by the first dp and tp rank of each stage). Experts under expert parallelism are `model/<param>`
slices of the whole tensor, each expert at its global index, saved by one rank of each
expert-data-parallel group. The engine adds
`master/<param>`, `optim.<key>/<param>` (flat shards) and `optim.step`. JSON-only state
(step, scheduler, data position) travels in the manifest's extras.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mshpc.checkpoint.reader import CheckpointReader
from mshpc.errors import CheckpointError, shown
from mshpc.parallel.zero import DP_ONLY, ModelParallel
from mshpc.tensor_slice import TensorSlice


def spread(sizes: list[int], ranks: int) -> list[int]:
    """An owner rank for each size: largest first, each to the rank with the fewest bytes so far
    (ties to the lowest rank). The same on every rank, since it is a function of its arguments."""
    load, owners = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


def model_slices(model: nn.Module, mp: ModelParallel = DP_ONLY, dp_rank: int = 0, dp: int = 1,
                 placement: Mapping[str, tuple[tuple[int, ...], int]] | None = None,
                 ep: int = 1) -> dict[str, TensorSlice]:
    """This dp rank's share of the weights, named as `mp` names them (a tp-replicated one from tp
    rank 0 only). Each weight is whole in one dp rank's shard, so it opens in plain h5py, and the
    dp ranks share the copying and writing. Had one rank saved them all, its stage 1 would set
    the save's blocking time: 1 + dp/3 times another rank's with fp32 weights (each rank copies
    12 bytes of masters and moments per weight / dp), 1 + dp/6 with bf16 weights. A weight in
    `placement` (an ep rank's experts: the whole tensor's shape, the local part's flat offset)
    is this rank's slice of it, shared out among the dp / `ep` ranks that hold the same slice."""
    placement = placement or {}
    named = [(n, p) for n, p in model.named_parameters() if mp.tp_rank == 0 or n not in mp.replicated]
    out = {}
    for mine, rank, ranks in ((False, dp_rank, dp), (True, dp_rank // ep, dp // ep)):
        kind = [(n, p) for n, p in named if (n in placement) == mine]
        owners = spread([p.numel() * p.element_size() for _, p in kind], ranks)
        for (n, p), owner in zip(kind, owners, strict=True):
            if owner == rank:
                shape, offset = placement.get(n, (tuple(p.shape), 0))
                out[f"model/{mp.checkpoint_key(n)}"] = TensorSlice(p.detach(), shape, offset)
    return out


def buffer_slices(model: nn.Module, first: bool) -> dict[str, TensorSlice]:
    """The model's persistent buffers (`buffer/<name>`), from the `first` rank of a stage only:
    every dp and tp rank holds the same values."""
    return {f"buffer/{n}": TensorSlice.whole(b.detach()) for n, b in persistent_buffers(model).items()} if first else {}


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that belong in a checkpoint: those in the state dict (a router's biases), not
    the derived ones (rotary tables, statistics)."""
    state = model.state_dict(keep_vars=True)
    return {n: b for n, b in model.named_buffers() if n in state}


def rng_slices(rank: int) -> dict[str, TensorSlice]:
    out = {f"rng/cpu/rank-{rank}": TensorSlice.whole(torch.get_rng_state())}
    if torch.cuda.is_available():
        out[f"rng/cuda/rank-{rank}"] = TensorSlice.whole(torch.cuda.get_rng_state())
    return out


def rng_names(reader: CheckpointReader, rank: int, same_world: bool) -> list[str]:
    """This rank's own generators in the checkpoint. At another world size the ranks no longer
    correspond, so the generators keep their fresh seeding."""
    if not same_world:
        return []
    return [n for n in (f"rng/cpu/rank-{rank}", f"rng/cuda/rank-{rank}") if n in reader.names("rng/")]


def stage_rng(reader: CheckpointReader, names: list[str]) -> dict[str, torch.Tensor]:
    return {n: reader.read_whole(n) for n in names}


def apply_rng(staged: dict[str, torch.Tensor]) -> None:
    for name, state in staged.items():
        if name.startswith("rng/cpu/"):
            torch.set_rng_state(state)
        elif torch.cuda.is_available():
            torch.cuda.set_rng_state(state)


def checked_scheduler_state(saved: Any, current: dict[str, Any], where: str) -> dict[str, Any]:
    """The scheduler state a manifest's extras hold, for `load_state_dict`: the keys of this
    scheduler's own state (`current`), each with a value of its kind; keys it does not have (an
    older torch's) are left out. torch's LRScheduler applies a state with `__dict__.update`, so
    any other key would set any attribute of the scheduler. A CheckpointError for a bad value."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: the scheduler state {shown(saved)} is not an object")
    for key, like in current.items():
        if key not in saved or not _same_kind(saved[key], like):
            raise CheckpointError(f"{where}: scheduler state {key}={shown(saved.get(key))} is not like this "
                                  f"scheduler's {shown(like)}")
    return {key: saved[key] for key in current}


def _same_kind(value: Any, like: Any) -> bool:
    """Whether JSON `value` is of the kind of `like`: the same type (an int for a float), finite
    numbers, lists of equal length item by item; `None` only where `like` is None."""
    if isinstance(like, bool) or like is None:
        return value is like if like is None else isinstance(value, bool)
    if isinstance(like, (int, float)):
        ok = isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool))
        return ok and (isinstance(like, float) or isinstance(value, int)) and math.isfinite(value)
    if isinstance(like, list):
        return isinstance(value, list) and len(value) == len(like) and all(map(_same_kind, value, like))
    return False


def checked_lrs(saved: Any, groups: int, where: str) -> list[float]:
    """The optimizer's per-group learning rates from a manifest: `groups` finite numbers >= 0."""
    if (not isinstance(saved, list) or len(saved) != groups
            or not all(_same_kind(lr, 0.0) and lr >= 0 for lr in saved)):
        raise CheckpointError(f"{where}: group_lrs={shown(saved)} are not {groups} learning rates")
    return [float(lr) for lr in saved]
