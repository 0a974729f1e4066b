"""ZeRO-2 data parallelism with its collectives overlapped with compute (MegaScale, Jiang et al.
2024, sec. 3.2; ZeRO, Rajbhandari et al. 2020, sec. 5: P_os+g).

The model's parameters stay ordinary replicated nn.Parameters, used for forward and backward
in their own dtype; they are views into one flat buffer per bucket. Gradients accumulate in
fp32 bucket buffers; each bucket is reduce-scattered from a backward hook as soon as its
gradients are complete, while backward goes on with earlier layers. Each rank then clips and
steps only its shard (fp32 masters and optimizer state: ~1/dp of the memory), and all-gathers
the updated shards bucket by bucket; the next forward of a module waits only for its own
bucket (a forward pre-hook). With overlap off the same engine communicates after backward and
gathers before returning from step(). On CPU ranks of one host the buckets live in shared
memory and the collectives read the peers' rows in place (mshpc/cpu_ranks/shared_buckets.py).

Under tensor parallelism each tp rank runs its own engine over its dp group. Parameters every tp
rank holds whole (the norms) get only a partial gradient under sequence parallelism, from the
rank's part of the sequence; they live in buckets of their own, whose reduced shards are summed
over the tp group too (Megatron's rule for sequence-parallel norms). The clipping norm is summed
over the model-parallel group as well, counting those parameters once.

A `ShardDomain` names parameters that are reduced, sharded and gathered over a group of their own
(an MoE's experts over their expert-data-parallel group): a bucket never mixes domains, and each
knows its group. Every element is still counted once in the clipping norm, summed over the dp
group, which holds every expert's peers when expert parallelism is carved out of dp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from mshpc.cpu_ranks import shared_buckets
from mshpc.cpu_ranks.shared_buckets import HostShared
from mshpc.parallel import comm
from mshpc.parallel.buckets import BucketLayout
from mshpc.parallel.sharded_optim import STATE_KEYS
from mshpc.parallel.zero3 import UnitGathers, resize
from mshpc.tensor_slice import SliceReader, TensorSlice

GRAD_DTYPE = torch.float32  # gradients are accumulated and reduced in fp32 whatever the compute dtype
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (norm + 1e-6)


@dataclass(frozen=True)
class ShardDomain:
    """Parameters reduced, sharded and gathered over a group of their own instead of the dp group
    (a mixture of experts' expert weights over their expert-data-parallel group). Their gradients
    are still divided by the mesh's dp: an expert's local gradient already sums the tokens its
    peers routed to it. `placement`: name -> (the whole tensor's shape, the flat offset of this
    rank's local parameter in it), so checkpoints hold the whole tensor (experts by global index)."""

    names: frozenset[str]  # as model.named_parameters() gives them
    group: dist.ProcessGroup
    placement: Mapping[str, tuple[tuple[int, ...], int]]


@dataclass(frozen=True)
class Bucket:
    """One bucket's buffers on this rank, and the group it is reduced and gathered over."""

    layout: BucketLayout
    params: torch.Tensor  # (numel,) parameter dtype; the model's parameters are views into it
    grads: torch.Tensor  # (numel,) fp32; each parameter's gradient is copied, then added, into its view
    master: torch.Tensor  # (shard_numel,) fp32: this rank's shard of the parameters
    # (shard_numel,) fp32, the reduce-scatter's output: at stage 2 this rank's rows of `grads`, in
    # place; at stage 3 a tensor of its own, since `grads` is freed after the reduce-scatter
    shard_grad: torch.Tensor
    rank: int  # this rank's index in `group`: its shard is elements [rank * n, (rank + 1) * n)
    group: dist.ProcessGroup | None  # the dp group, or its domain's group (ShardDomain)
    tp_replicated: bool = False  # holds parameters every tp rank has whole (see the module doc)
    tied: bool = False  # holds one tied parameter alone: the same shard as its copy's on the tied group
    # the buffers in memory the group's ranks all map (cpu_ranks/shared_buckets.py): params at shared_index,
    # grads at shared_index + 1
    shared: HostShared | None = None
    shared_index: int = 0

    def reduce_scatter(self) -> comm.Pending | None:
        """Start summing the gradients over the bucket's group into shard_grad; collective over it."""
        if self.shared is not None:
            return shared_buckets.reduce_scatter(self.shared, self.shared_index + 1, self.shard_grad)
        # async: on NCCL the collective runs on its own stream, on gloo as point-to-point sends
        return comm.reduce_scatter(self.shard_grad, self.grads, self.group, async_op=True)

    def all_gather(self, source: torch.Tensor) -> comm.Pending | None:
        """Start gathering every member's `source` (its shard, parameter dtype) into params;
        collective over the bucket's group."""
        if self.shared is not None:
            return shared_buckets.all_gather(self.shared, self.shared_index, source)
        return comm.all_gather(self.params, source, self.group, async_op=True)


@dataclass(frozen=True)
class ShardPiece:
    """A parameter's part in this rank's shard: the optimizer's tensor and its checkpoint name."""

    name: str  # the parameter's name in the model
    shape: tuple[int, ...]
    start: int  # flat offset in the parameter
    tensor: torch.Tensor  # view into its bucket's master shard
    key: str  # its name in checkpoints: a tp shard's carries its tp rank (`<name>@tp<r>`)
    saved: bool  # False on tp ranks > 0 for a tp-replicated parameter: tp rank 0 saves it
    # elements that are a copy of rows another tp rank counts in the clip norm (replicated kv
    # heads); None: every element counts
    uncounted: torch.Tensor | None = None


@dataclass(frozen=True)
class ModelParallel:
    """How the model an engine wraps is split besides dp. tp: the tensor-parallel group;
    replicated: names of the parameters every tp rank holds whole; norm: the group the clipping
    norm is summed over besides dp (the model-parallel group: tp x pp); tied: names of the
    parameters another pipeline stage holds a copy of (a tied embedding: first and last stage),
    whose gradients are summed over tied_group."""

    tp: dist.ProcessGroup | None = None
    replicated: frozenset[str] = field(default_factory=frozenset)
    norm: dist.ProcessGroup | None = None
    tied: frozenset[str] = field(default_factory=frozenset)
    tied_group: dist.ProcessGroup | None = None
    # by name: a mask (the parameter's shape) of rows several tp ranks hold copies of and
    # another one counts in the norm (kv heads fewer than tp: tp_split.RowCopy)
    copies: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else dist.get_world_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else dist.get_rank(self.tp)

    def checkpoint_key(self, name: str) -> str:
        return name if self.tp_size == 1 or name in self.replicated else f"{name}@tp{self.tp_rank}"

    def counts_tied(self, name: str) -> bool:
        """False for a tied copy this rank does not count in the norm: the first rank of the
        tied group counts it."""
        return name not in self.tied or dist.get_rank(self.tied_group) == 0


DP_ONLY = ModelParallel()  # the model whole on every dp rank: no tp, no pp, nothing tied


def _counted(piece: ShardPiece) -> torch.Tensor:
    """The gradient of `piece` that this rank counts in the norm (its own copy of shared rows
    zeroed: their owner counts them)."""
    grad = cast(torch.Tensor, piece.tensor.grad)
    return grad if piece.uncounted is None else grad.masked_fill(piece.uncounted, 0.0)


class ZeroEngine:
    """Built by `build_zero_engine` (zero_build.py). Per step, every dp rank calls backward()
    once per micro-batch (sync=True on the last) and then step(); the model's .grad stay None
    (its gradients live in the fp32 buckets), and after step() its parameters are landing,
    bucket by bucket, as the next forward needs them. At stage 3 (`units`) they land unit by
    unit instead, each gathered for its forward and backward (zero3.py)."""

    def __init__(
        self, model: nn.Module, params: list[nn.Parameter], buckets: list[Bucket],
        bucket_of: list[int], grad_views: list[torch.Tensor], pieces: list[ShardPiece],
        optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None, overlap: bool,
        mp: ModelParallel, units: UnitGathers | None = None,
    ) -> None:
        self.model = model
        self.params = params
        self.buckets = buckets
        self.bucket_of = bucket_of  # parameter index -> bucket index
        self.grad_views = grad_views  # parameter index -> its fp32 gradient in its bucket
        self.pieces = pieces
        self.optimizer = optimizer
        self.group = group
        self.overlap = overlap
        self.mp = mp
        self.units = units  # stage 3: the parameters' units, gathered per use
        # some buckets' buffers live in shared memory (zero_build.map_shared_buckets)
        self.shared = any(b.shared is not None for b in buckets)
        self.dp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._ready = [0] * len(buckets)  # parameters whose gradient is complete, per bucket
        # per parameter: no gradient accumulated into its bucket view yet this step, so the
        # next one is copied in, not added (the buckets are never zeroed; see _on_grad)
        self._fresh = [True] * len(params)
        self._next_reduce = 0  # reduce-scatters start in bucket order, identical on every rank
        self._reducing: list[comm.Pending | None] = []
        self._reduced = 0  # reduce-scatters waited for this step (stage 3 frees their buffers)
        self._gathering: dict[int, tuple[comm.Pending | None, torch.Tensor]] = {}
        self._sync = False
        self._before_update: list[Callable[[], None]] = []

    # ------------------------------------------------------------ the step

    def backward(self, loss: torch.Tensor, sync: bool = True, grad: torch.Tensor | None = None,
                 flush: bool | None = None) -> None:
        """Backward of `loss` (or of a pipeline stage's output, `grad` being its gradient),
        accumulating gradients. sync=True on a step's last micro-batch: then every bucket is
        reduce-scattered (as its gradients complete with overlap, after backward without);
        earlier micro-batches communicate nothing. A rank with several pipeline chunks syncs
        each chunk's last backward and flushes (launches what is left) only after the step's
        last; flush defaults to sync. Collective over the dp group when sync."""
        self._sync = sync
        try:
            loss.backward(grad)
        finally:
            self._sync = False
        if self.units is not None:
            self.units.free_all()  # FSDP2's reshard after backward: the next forward gathers again
        if sync if flush is None else flush:
            # without overlap: every bucket; with: those a parameter without a gradient held back
            self._launch_reduces(force=True)

    def step(self, max_norm: float = math.inf) -> torch.Tensor:
        """Finish the reduce-scatters, clip the gradients to `max_norm` by their global norm
        (torch.nn.utils.clip_grad_norm_'s rule over the unsharded gradients), step this rank's
        shard and start the all-gathers of the updated parameters. Returns the norm before
        clipping. Collective over the dp group."""
        assert self._next_reduce == len(self.buckets), "step() needs backward(loss, sync=True) first"
        self._finish_reduces(len(self.buckets))
        for b in self.buckets:
            if b.tp_replicated and self.mp.tp_size > 1:  # partial sums over the sequence shards
                comm.all_reduce(b.shard_grad, group=self.mp.tp)
            if b.tied:  # plus the gradient of the copy on the other stage: its shard is this one
                comm.all_reduce(b.shard_grad, group=self.mp.tied_group)
        shards = [b.shard_grad for b in self.buckets]
        if self.dp > 1:
            torch._foreach_div_(shards, float(self.dp))  # sum -> mean over the global batch
        norm = self._clip(shards, max_norm)
        self.wait_params()  # a bucket no forward used may still be gathering from its master
        self._settle()
        first, units = self._first_unit_pieces(), self.units
        if first is not None and units is not None:
            # stage 3: the first unit's gather overlaps the rest of the optimizer step (a step of
            # gpt-125m's shards takes about as long on CPU as the embedding's gather at 1 Gbit/s)
            units.free_all()
            self._step_pieces(first)
            units.gather(units.uses[0].unit)
            early = {id(p.tensor) for p in first}
            self._step_pieces([p for p in self.pieces if id(p.tensor) not in early])
        else:
            self.optimizer.step()
            self._start_gathers()
        if not self.overlap:
            self.wait_params()
        self._next_step()
        return norm

    def _first_unit_pieces(self) -> list[ShardPiece] | None:
        """Stage 3 with overlap and several units: this rank's pieces of the unit the next forward
        uses first (the embedding's), stepped before the others so that its gather starts first;
        else None. Decided alike on every rank (a LAMB step is collective), whatever its pieces."""
        if self.units is None or not self.overlap or len(self.units.units) < 2 or not self.units.uses:
            return None
        masters = {self.buckets[b].master.untyped_storage().data_ptr()
                   for b in self.units.units[self.units.uses[0].unit]}
        return [p for p in self.pieces if p.tensor.untyped_storage().data_ptr() in masters]

    def _step_pieces(self, pieces: list[ShardPiece]) -> None:
        """Step only `pieces`: the optimizers update what has a gradient, so the others' are
        held back for the call. Every update is elementwise per piece (LAMB's norms per whole
        parameter, which one unit holds), so two calls give the bits one would."""
        stepped = {id(p.tensor) for p in pieces}
        held = [(p.tensor, p.tensor.grad) for p in self.pieces if id(p.tensor) not in stepped]
        for tensor, _ in held:
            tensor.grad = None
        try:
            self.optimizer.step()
        finally:
            for tensor, grad in held:
                tensor.grad = grad

    def wait_params(self) -> None:
        """Block until every bucket's all-gather has landed in the model's parameters (local:
        the collectives were started by step()); forward pre-hooks do this bucket by bucket. At
        stage 3: until the units' gathers in flight have landed."""
        if self.units is not None:
            self.units.wait_all()
        self._wait_gathers(tuple(self._gathering))

    def before_next_update(self, fn: Callable[[], None]) -> None:
        """Run `fn` once, before the state is next written: the optimizer's step (masters,
        moments, step counter and, through the all-gathers, the weights) or a load. A checkpoint
        whose stage 1 still reads the state finishes it there."""
        self._before_update.append(fn)

    def _settle(self) -> None:
        hooks, self._before_update = self._before_update, []
        for fn in hooks:
            fn()

    def optimizer_state_bytes(self) -> int:
        """Bytes this rank keeps for the optimizer: fp32 master shards plus optimizer state."""
        tensors = [b.master for b in self.buckets]
        tensors += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------ checkpoint interface

    def state_slices(self) -> dict[str, TensorSlice]:
        """This rank's fp32 masters and optimizer state as slices of the whole parameters
        (`master/<key>`, `optim.<state>/<key>`, keys as in ShardPiece), plus `optim.step` from the
        first rank of the dp and model-parallel groups only; no slice is held by two ranks. Views
        into live state: copy them before the next update (see before_next_update)."""
        out = {}
        for piece in self.pieces:
            if not piece.saved:
                continue
            out[f"master/{piece.key}"] = TensorSlice(piece.tensor, piece.shape, piece.start)
            for key in STATE_KEYS:
                state = self.optimizer.state[piece.tensor][key]
                out[f"optim.{key}/{piece.key}"] = TensorSlice(state, piece.shape, piece.start)
        first = self.mp.tp_rank == 0 and (self.mp.norm is None or dist.get_rank(self.mp.norm) == 0)
        if self.rank == 0 and first and self.pieces:
            out["optim.step"] = TensorSlice.whole(self.optimizer.state[self.pieces[0].tensor]["step"])
        return out

    def weight_slices(self) -> dict[str, TensorSlice]:
        """Stage 3's `model/<key>` copy for checkpoints: this rank's pieces of the weights, cast
        from its masters as the all-gather casts them (stage 2 saves each weight whole instead:
        checkpoint/state.model_slices)."""
        dtype = self.params[0].dtype if self.params else torch.float32
        return {f"model/{p.key}": TensorSlice(p.tensor.to(dtype), p.shape, p.start) for p in self.pieces if p.saved}

    @torch.no_grad()
    def load_state_slices(self, read: SliceReader) -> None:
        """Rebuild this rank's shards under the current layout from `read(name, start, numel)`
        (any dp may have written them), then refresh the model's parameters from the masters.
        Collective over the dp group (an all-gather)."""
        self.wait_params()
        self._settle()
        step = read("optim.step", 0, 1).reshape(()).to("cpu", torch.float32)
        for piece in self.pieces:
            numel = piece.tensor.numel()
            piece.tensor.copy_(read(f"master/{piece.key}", piece.start, numel))
            state = self.optimizer.state[piece.tensor]
            for key in STATE_KEYS:
                state[key].copy_(read(f"optim.{key}/{piece.key}", piece.start, numel))
            state["step"] = step.clone()
        self._start_gathers()
        self.wait_params()

    # ------------------------------------------------------------ hooks and collectives

    def _on_grad(self, index: int) -> None:
        """Post-accumulate-grad hook of parameter `index`: the step's first gradient is copied
        into its bucket view, later micro-batches' are added. .grad stays None between calls,
        so autograd hands over the gradient it computed (no add into a .grad, no copy) and the
        buckets need no zeroing per step: one pass over the gradient where a zeroed bucket
        took three (memset, then autograd's read-read-write add)."""
        p, view = self.params[index], self.grad_views[index]
        grad = p.grad
        assert grad is not None  # the hook runs after autograd has accumulated it
        if self.units is not None:
            self._allocate_grads(self.buckets[self.bucket_of[index]])
        if self._fresh[index]:
            view.copy_(grad)  # casts a bf16 parameter's gradient to fp32
            self._fresh[index] = False
        else:
            view.add_(grad)
        p.grad = None
        if self._sync and self.overlap:
            self._ready[self.bucket_of[index]] += 1
            self._launch_reduces(force=False)

    def _launch_reduces(self, force: bool) -> None:
        # In bucket order only, so that every rank issues the same collectives in the same order
        # whatever order its hooks fire in; `force` starts the rest (after backward).
        while self._next_reduce < len(self.buckets):
            bucket = self.buckets[self._next_reduce]
            if not force and self._ready[self._next_reduce] < len(bucket.layout.slots):
                return
            if self._next_reduce == 0 and self.shared:
                # the step's first signal to the peers: every read of their rows for the last
                # step's gathers must be done before it (cpu_ranks/shared_buckets.py)
                self.wait_params()
            if self.units is not None:
                self._allocate_grads(bucket)  # no parameter of it had a gradient
            self._zero_unused(bucket)
            self._reducing.append(bucket.reduce_scatter())
            self._next_reduce += 1
            if self.units is not None:  # one reduce-scatter in flight, FSDP2's rule: its input is freed
                self._finish_reduces(self._next_reduce - 1)

    def _finish_reduces(self, end: int) -> None:
        """Wait for the reduce-scatters of buckets before `end`; at stage 3 free their buffers."""
        while self._reduced < min(end, len(self._reducing)):
            work = self._reducing[self._reduced]
            if work is not None:
                work.wait()
            if self.units is not None:
                resize(self.buckets[self._reduced].grads, 0)
            self._reduced += 1

    def _allocate_grads(self, bucket: Bucket) -> None:
        """Stage 3: the bucket's gradient buffer, from its first gradient of the step until its
        reduce-scatter is done; padding zeroed (it is summed with the rest)."""
        grads = bucket.grads
        if grads.untyped_storage().nbytes() == 0:
            resize(grads, grads.numel())
            used = sum(slot.numel for slot in bucket.layout.slots)
            grads[used:].zero_()

    def _zero_unused(self, bucket: Bucket) -> None:
        # a parameter no micro-batch of this step reached (unused, or a frozen branch) would
        # still hold an earlier step's gradient in its view
        for slot in bucket.layout.slots:
            if self._fresh[slot.index]:
                self.grad_views[slot.index].zero_()

    def _clip(self, shards: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the reduced shards so that the L2 norm of the whole model's gradient is at most
        max_norm; an all-reduce of a scalar over the dp group, and one over the model-parallel
        group. Each parameter counts once, as in the unsplit model: a tp-replicated one on tp rank
        0, a tied one on the first rank of its tied group."""
        # a piece's grad is its span of the reduced shard, set once when the engine is built
        counted = [_counted(p) for p in self.pieces if p.saved and self.mp.counts_tied(p.name)]
        # summed in fp64, so that how the buckets cut the parameters (stage 2's buckets of
        # bucket_mb, stage 3's units, any dp) does not change the fp32 norm: same clipping, same bits
        norms = list(torch._foreach_norm(counted, 2, dtype=torch.float64)) if counted else []
        norm_sq = torch.stack(norms).square().sum() if norms else shards[0].new_zeros((), dtype=torch.float64)
        comm.all_reduce(norm_sq, group=self.group)
        if self.mp.norm is not None and dist.get_world_size(self.mp.norm) > 1:
            comm.all_reduce(norm_sq, group=self.mp.norm)
        norm = norm_sq.sqrt().float()
        if not math.isinf(max_norm):
            coef = (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)
            torch._foreach_mul_(shards, coef)
        return norm

    def _start_gathers(self) -> None:
        if self.units is not None:  # stage 3: every gathered unit is stale; the first use's comes now
            self.units.free_all()
            if self.overlap and self.units.uses:
                self.units.gather(self.units.uses[0].unit)
            return
        # Forward order: the last bucket holds the first layers (buckets follow backward).
        for b in reversed(range(len(self.buckets))):
            bucket = self.buckets[b]
            source = bucket.master.to(bucket.params.dtype)  # no copy for fp32 parameters
            # the source rides along with its Work: NCCL reads it until the gather completes
            self._gathering[b] = (bucket.all_gather(source), source)

    def _wait_gathers(self, buckets: tuple[int, ...]) -> None:
        for b in buckets:
            work, _ = self._gathering.pop(b, (None, None))
            if work is not None:
                work.wait()

    def _next_step(self) -> None:
        # nothing to zero: the next step's first gradients overwrite the bucket views
        self._fresh = [True] * len(self.params)
        self._ready = [0] * len(self.buckets)
        self._next_reduce = 0
        self._reducing = []
        self._reduced = 0


# ---------------------------------------------------------------- building
