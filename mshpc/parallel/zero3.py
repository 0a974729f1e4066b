"""ZeRO-3 (`parallel.zero_stage: 3`): the parameters sharded too (ZeRO, Rajbhandari et al. 2020,
sec. 5: P_os+g+p; PyTorch's FSDP2 `fully_shard`), in the ZeRO-2 engine's own buckets.

Each unit (a block, `parallel.zero3_blocks_per_unit` blocks, or the parts before and after the
blocks) is one or more buckets. Between uses a rank keeps only its 1/dp shard of them, the fp32
master the optimizer steps; a unit's full parameters are all-gathered into its buckets' buffers
just before its forward, with the next unit's gather issued while this one computes (prefetch one
ahead in forward order, one behind in backward), and their storage is freed after use
(`parallel.reshard_after_forward`) and after backward. The model's parameters stay views into
those buffers; only the storage under them comes and goes, as FSDP2's does. Between uses a
parameter keeps its shape but has no storage: code outside forward and backward reads weights
through the engine's slices (`state_slices`, `weight_slices`), as checkpoints do.

Where mshpc differs from FSDP2 (docs/parallelism.md): the embedding's and the lm head's units
are freed between their uses like the blocks', so that at most two units are gathered at once,
and an embedding's unit is not gathered again for its backward, which reads no weight; units
are gathered in the parameters' dtype, as stage 2 gathers them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mshpc.errors import ConfigError
from mshpc.parallel import comm
from mshpc.parallel.vocab_embedding import VocabParallelEmbedding

# Modules whose backward reads no weight (only the token ids): their unit is not gathered for it.
NO_WEIGHT_BACKWARD = (nn.Embedding, VocabParallelEmbedding)
FREE, GATHERING, GATHERED = "free", "gathering", "gathered"
Watch = Callable[[str, int], None]  # ("before" | "after" a storage change, parameter bytes held)


@dataclass(frozen=True)
class Use:
    """One place in the forward where a unit's parameters are needed: `modules` run in this
    order, and `backward` says whether their backward reads the weights."""

    unit: int
    modules: tuple[nn.Module, ...]
    backward: bool


def needs_weights_in_backward(modules: tuple[nn.Module, ...]) -> bool:
    return not all(isinstance(m, NO_WEIGHT_BACKWARD) for m in modules)


def resize(tensor: torch.Tensor, numel: int) -> None:
    """Allocate (numel > 0) or free (0) the storage under `tensor` and every view of it."""
    tensor.untyped_storage().resize_(numel * tensor.element_size())


class UnitGathers:
    """The units' state on this rank (free, gathering, gathered) and the hooks that move it.
    `buckets` are the engine's; unit u holds buckets `units[u]`; `uses` are in forward order.
    Gathers and frees are collective over each bucket's group, issued by every rank in the same
    order, since every rank runs the same forward and backward."""

    def __init__(self, buckets: list[Any], units: list[tuple[int, ...]], uses: list[Use], overlap: bool,
                 reshard_after_forward: bool) -> None:
        self.buckets, self.units, self.uses = buckets, units, uses
        self.overlap, self.reshard_after_forward = overlap, reshard_after_forward
        self.state = [FREE] * len(units)  # as built: zero_build frees each bucket once its shard is cut
        self._pending: dict[int, list[tuple[comm.Pending | None, torch.Tensor]]] = {}
        # called just before and after each allocation and free of a unit's storage, with the
        # parameter bytes held: tests hold it to the allocator's own accounting
        self.watch: Watch | None = None
        # the fp32 shards, always held, plus every unit gathered now
        self.held_bytes = sum(b.master.numel() * b.master.element_size() for b in buckets)

    def unit_bytes(self, u: int) -> int:
        return sum(self.buckets[b].params.numel() * self.buckets[b].params.element_size() for b in self.units[u])

    # ------------------------------------------------------------ gather, wait, free

    def gather(self, u: int) -> None:
        """Start gathering unit u's parameters (nothing if they are there or on their way)."""
        if self.state[u] != FREE:
            return
        self._storage(u, allocate=True)
        works = []
        for b in self.units[u]:
            bucket = self.buckets[b]
            source = bucket.master.to(bucket.params.dtype)  # no copy for fp32 parameters
            # autograd saved these weights in forward; new values of the same weights are no
            # in-place change to them (FSDP2 keeps the version counter alike)
            with torch.autograd._unsafe_preserve_version_counter(bucket.params):
                works.append((bucket.all_gather(source), source))  # the source rides along: NCCL reads it
        self._pending[u] = works
        self.state[u] = GATHERING

    def wait(self, u: int) -> None:
        if self.state[u] == GATHERING:
            for work, _ in self._pending.pop(u):
                if work is not None:
                    work.wait()
            self.state[u] = GATHERED

    def free(self, u: int) -> None:
        if self.state[u] == FREE:
            return
        self.wait(u)  # a collective may still be writing into the storage
        self._storage(u, allocate=False)
        self.state[u] = FREE

    def wait_all(self) -> None:
        for u in list(self._pending):
            self.wait(u)

    def free_all(self) -> None:
        for u in range(len(self.units)):
            self.free(u)

    def _storage(self, u: int, allocate: bool) -> None:
        if self.watch is not None:
            self.watch("before", self.held_bytes)
        for b in self.units[u]:
            params = self.buckets[b].params
            resize(params, params.numel() if allocate else 0)
        self.held_bytes += self.unit_bytes(u) if allocate else -self.unit_bytes(u)
        if self.watch is not None:
            self.watch("after", self.held_bytes)

    # ------------------------------------------------------------ hooks

    def register(self) -> None:
        """Forward pre-hooks on every module of a use (the first one gathers), a forward hook on
        its last (frees, and hooks its output's gradient: the use's pre-backward)."""
        for k, use in enumerate(self.uses):
            for module in use.modules:
                module.register_forward_pre_hook(functools.partial(self._pre_forward, k))
            use.modules[-1].register_forward_hook(functools.partial(self._post_forward, k))

    def _pre_forward(self, k: int, *_: Any) -> None:
        u = self.uses[k].unit
        self.gather(u)
        if self.overlap and k + 1 < len(self.uses):
            self.gather(self.uses[k + 1].unit)  # issued before this unit computes: it overlaps it
        self.wait(u)

    def _post_forward(self, k: int, _module: nn.Module, _args: Any, output: Any) -> None:
        training = torch.is_grad_enabled()
        use = self.uses[k]
        if training and use.backward:
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, k))
        last = k == len(self.uses) - 1  # its backward comes next: keep it (FSDP2's root does too)
        keep = training and (last or not self.reshard_after_forward)
        if not keep and not self._used_later(k):
            self.free(use.unit)

    def _used_later(self, k: int) -> bool:
        # the next use's unit was prefetched by this one's pre-hook: never free it here
        return k + 1 < len(self.uses) and self.uses[k + 1].unit == self.uses[k].unit

    def _pre_backward(self, k: int, _grad: torch.Tensor) -> None:
        """Runs once use k's output gradient is complete: every later use's backward is done."""
        u = self.uses[k].unit
        needed = {use.unit for use in self.uses[:k + 1] if use.backward}
        for v, state in enumerate(self.state):
            if state != FREE and v not in needed:
                self.free(v)  # reshard after backward
        self.gather(u)
        before = [use for use in self.uses[:k] if use.backward]
        if self.overlap and before:
            self.gather(before[-1].unit)  # the previous unit's gather overlaps this one's backward
        self.wait(u)


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


# ---------------------------------------------------------------- building


def block_units(blocks: list[tuple[int, nn.Module]], per_unit: int) -> tuple[tuple[nn.Module, ...], ...]:
    """The blocks (layer index, block) in groups of `per_unit` consecutive layers: a group never
    spans a gap in the indices (a pipeline rank's chunks are apart), so it never spans two chunks."""
    runs: list[list[nn.Module]] = []
    last = None
    for index, block in blocks:
        if last is None or index != last + 1:
            runs.append([])
        runs[-1].append(block)
        last = index
    return tuple(tuple(run[i:i + per_unit]) for run in runs for i in range(0, len(run), per_unit))


def build_units(model: nn.Module, named: list[tuple[str, nn.Parameter]],
                blocks: tuple[tuple[nn.Module, ...], ...]) -> tuple[list[list[int]], list[Use]]:
    """The units (parameter indices into `named`, ascending) in order of first use, and the uses
    in forward order: the model's children before the blocks (the embedding), each group of
    `blocks`, the children after them (final norm, lm head). The parts before and after share
    one unit, used twice, when they share a parameter (tied embeddings). Without blocks the whole
    model is one unit."""
    index_of = {id(p): i for i, (_, p) in enumerate(named)}

    def params_of(modules: tuple[nn.Module, ...]) -> list[int]:
        return sorted({index_of[id(p)] for m in modules for p in m.parameters() if id(p) in index_of})

    if not blocks:
        return [list(range(len(named)))], [Use(0, (model,), True)] if named else []
    inside = {id(m) for group in blocks for block in group for m in block.modules()}
    children = [c for c in model.children() if params_of((c,))]
    holds = [any(id(m) in inside for m in c.modules()) for c in children]
    first = holds.index(True)
    before = tuple(c for c, h in zip(children[:first], holds[:first], strict=True) if not h)
    after = tuple(c for c, h in zip(children[first:], holds[first:], strict=True) if not h)
    groups = [g for g in (before, *blocks, after) if g]
    units: list[list[int]] = []
    uses: list[Use] = []
    for group in groups:
        mine = params_of(group)
        shared = next((u for u, unit in enumerate(units) if set(unit) & set(mine)), None)
        if shared is None:
            units.append(mine)
            shared = len(units) - 1
        else:  # tied: one unit, a second use
            units[shared] = sorted(set(units[shared]) | set(mine))
        uses.append(Use(shared, group, needs_weights_in_backward(group)))
    covered = {i for unit in units for i in unit}
    missing = [name for i, (name, _) in enumerate(named) if i not in covered]
    if missing or sum(map(len, units)) != len(covered):
        raise ConfigError(f"parallel.zero_stage=3 needs every parameter in one submodule of the model's "
                          f"embedding, blocks or head; {', '.join(missing) or 'a parameter shared by two blocks'} "
                          "is not (choose parallel.zero_stage=2)")
    return units, uses
