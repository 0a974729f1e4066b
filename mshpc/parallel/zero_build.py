"""Building the ZeRO engine (zero.py): its buckets, the parameters moved into their flat
buffers, this rank's master shard and pieces, the optimizer over those pieces, and the hooks
that drive the overlap. Each part is a small `build_*` function, in the order they run."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from mshpc.config import OptimConfig, ParallelConfig
from mshpc.errors import ConfigError
from mshpc.optim.optimizer import param_groups
from mshpc.parallel import comm
from mshpc.parallel.buckets import BucketLayout, build_buckets
from mshpc.parallel.host_shared import HostShared, map_buffers
from mshpc.parallel.sharded_optim import build_shard_optimizer
from mshpc.parallel.zero import DP_ONLY, GRAD_DTYPE, Bucket, ModelParallel, ShardPiece, ZeroEngine


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # ties once
    dtypes = sorted({str(p.dtype) for _, p in named})
    if len(dtypes) > 1:
        raise ConfigError(f"the ZeRO engine needs one parameter dtype; the model has {', '.join(dtypes)} "
                          "(cast the model to one, e.g. model.float())")
    return named


def build_layouts(numels: list[int], tp_replicated: list[bool], tied: list[bool], bucket_numel: int,
                  dp: int) -> list[BucketLayout]:
    """Buckets of the parameters tp ranks split, then buckets of those every tp rank holds whole
    (without tensor parallelism: all of them in the first kind). The second kind comes last:
    their reduce-scatters start in bucket order, and the first layer's norm completes them. A
    tied parameter gets a bucket of its own."""
    layouts = []
    for kind in (False, True):
        indices = [i for i, rep in enumerate(tp_replicated) if rep == kind]
        alone = frozenset(k for k, i in enumerate(indices) if tied[i])
        for layout in build_buckets([numels[i] for i in indices], bucket_numel, dp, alone):
            slots = tuple(dataclasses.replace(slot, index=indices[slot.index]) for slot in layout.slots)
            layouts.append(dataclasses.replace(layout, slots=slots))
    return layouts


def build_bucket_buffers(
    params: list[nn.Parameter], layouts: list[BucketLayout], rank: int, group: dist.ProcessGroup | None,
    tp_replicated: list[bool], tied: list[bool], shared: HostShared | None = None,
) -> list[Bucket]:
    """Move each parameter into its bucket's flat buffer (the parameter becomes a view), make
    every rank's parameters dp rank 0's, and cut this rank's fp32 master shard. Collective over
    the dp group (a broadcast per bucket). With `shared`, bucket b's parameters and gradients are
    its buffers 2b and 2b + 1 (map_shared_buckets' order)."""
    buckets = []
    for b, layout in enumerate(layouts):
        p0 = params[layout.slots[0].index]
        if shared is not None:
            flat, grads = shared.local[2 * b], shared.local[2 * b + 1]  # zeroed when mapped
        else:
            flat = torch.zeros(layout.numel, dtype=p0.dtype, device=p0.device)
            grads = torch.zeros(layout.numel, dtype=GRAD_DTYPE, device=p0.device)
        for slot in layout.slots:
            p = params[slot.index]
            flat[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            p.data = flat[slot.offset:slot.offset + slot.numel].view(p.shape)
        # DDP's rule: start from one replica's weights, whatever each rank initialised
        comm.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        lo = rank * layout.shard_numel
        master = flat[lo:lo + layout.shard_numel].to(torch.float32, copy=True)
        first = layout.slots[0].index
        buckets.append(Bucket(layout, flat, grads, master, rank, tp_replicated[first], tied[first]))
    return buckets


def map_shared_buckets(params: list[nn.Parameter], layouts: list[BucketLayout], parallel: ParallelConfig,
                       group: dist.ProcessGroup | None) -> HostShared | None:
    """The buckets' buffers in memory the dp group's ranks all map (host_shared.py), where that
    helps and works: CPU parameters on gloo, more than one rank, all on this host. Collective
    over the dp group."""
    on_cpu = all(p.device.type == "cpu" for p in params)
    if not (parallel.dp_shared_memory and on_cpu and dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo"):
        return None
    dtypes = [params[layout.slots[0].index].dtype for layout in layouts]
    specs = [spec for layout, dtype in zip(layouts, dtypes, strict=True)
             for spec in ((layout.numel, dtype), (layout.numel, GRAD_DTYPE))]
    return map_buffers(specs, group)


def build_grad_views(params: list[nn.Parameter], buckets: list[Bucket]) -> list[torch.Tensor]:
    """Each parameter's fp32 gradient inside its bucket, where its hook copies or adds what
    autograd computed (ZeroEngine._on_grad); .grad itself stays None."""
    views: list[torch.Tensor] = [torch.empty(0)] * len(params)
    for bucket in buckets:
        for slot in bucket.layout.slots:
            p = params[slot.index]
            views[slot.index] = bucket.grads[slot.offset:slot.offset + slot.numel].view(p.shape)
            p.grad = None
    return views


def build_shard_pieces(
    named: list[tuple[str, nn.Parameter]], buckets: list[Bucket], rank: int, mp: ModelParallel
) -> list[ShardPiece]:
    """This rank's part of every parameter, as views into the master shards, each with its
    .grad a view into the reduced gradient shard, and its checkpoint key."""
    pieces = []
    for bucket in buckets:
        shard_grad = bucket.shard_grad
        for piece in bucket.layout.pieces(rank):
            name, p = named[piece.index]
            span = slice(piece.shard_offset, piece.shard_offset + piece.numel)
            tensor = bucket.master[span]
            tensor.grad = shard_grad[span]
            saved = mp.tp_rank == 0 or not bucket.tp_replicated
            copies = mp.copies.get(name)
            uncounted = None if copies is None else copies.reshape(-1)[piece.param_start:piece.param_start + piece.numel]
            pieces.append(ShardPiece(name, tuple(p.shape), piece.param_start, tensor, mp.checkpoint_key(name), saved,
                                     uncounted))
    return pieces


def build_piece_groups(
    model: nn.Module, named: list[tuple[str, nn.Parameter]], pieces: list[ShardPiece], weight_decay: float
) -> list[dict]:
    """The model's optimizer groups (mshpc.optim.optimizer.param_groups: which parameters
    decay), with each parameter replaced by this rank's piece of it; empty groups are kept, so
    that every rank has the same groups for the LR schedule."""
    model_groups = param_groups(model, weight_decay)
    index_of = {id(p): i for i, (_, p) in enumerate(named)}
    name_index = {name: i for i, (name, _) in enumerate(named)}
    group_of = {index_of[id(p)]: g for g, grp in enumerate(model_groups) for p in grp["params"]}
    groups = [{"params": [], "owner": [], "weight_decay": grp["weight_decay"]} for grp in model_groups]
    for piece in pieces:
        index = name_index[piece.name]
        groups[group_of[index]]["params"].append(piece.tensor)
        groups[group_of[index]]["owner"].append(index)
    return groups


def _register_hooks(engine: ZeroEngine, units: tuple[nn.Module, ...]) -> None:
    """Gradient hooks per parameter; forward pre-hooks that wait for a module's all-gathered
    weights, per module, or once per unit (a compiled block) for everything inside it: a hook
    inside a compiled graph would be traced, and its wait on a collective cannot be."""
    for i, p in enumerate(engine.params):
        p.register_post_accumulate_grad_hook(lambda _, i=i: engine._on_grad(i))
    index_of = {id(p): i for i, p in enumerate(engine.params)}
    unit_ids = {id(u) for u in units}
    inside = {id(m) for u in units for m in u.modules() if m is not u}
    for module in engine.model.modules():
        if id(module) in inside:
            continue
        mine = module.parameters(recurse=id(module) in unit_ids)
        own = {engine.bucket_of[index_of[id(p)]] for p in mine if id(p) in index_of}
        if own:
            buckets = tuple(sorted(own))
            module.register_forward_pre_hook(lambda *_, b=buckets: engine._wait_gathers(b))


def build_zero_engine(
    model: nn.Module, optim: OptimConfig, parallel: ParallelConfig, group: dist.ProcessGroup | None = None,
    mp: ModelParallel = DP_ONLY, fused: bool = False, hook_units: tuple[nn.Module, ...] = (),
) -> ZeroEngine:
    """Apply ZeRO-2 data parallelism to `model` (already on its device) over the dp `group`
    (None: the world), with the optimizer named by `optim` (its multi-tensor kernel version when
    `fused`); `mp` says how the model is split besides; each of `hook_units` (compiled blocks)
    waits for its weights as a whole. Collective over the dp group."""
    named = _trainable(model)
    params = [p for _, p in named]
    rank, dp = dist.get_rank(group), dist.get_world_size(group)
    bucket_numel = max(1, int(parallel.bucket_mb * 2**20) // GRAD_DTYPE.itemsize)  # MiB of fp32 grads
    replicated = [mp.tp_size > 1 and name in mp.replicated for name, _ in named]
    tied = [name in mp.tied for name, _ in named]
    layouts = build_layouts([p.numel() for p in params], replicated, tied, bucket_numel, dp)
    shared = map_shared_buckets(params, layouts, parallel, group)
    buckets = build_bucket_buffers(params, layouts, rank, group, replicated, tied, shared)
    bucket_of = [0] * len(params)
    for b, layout in enumerate(layouts):
        for slot in layout.slots:
            bucket_of[slot.index] = b
    grad_views = build_grad_views(params, buckets)
    pieces = build_shard_pieces(named, buckets, rank, mp)
    groups = build_piece_groups(model, named, pieces, optim.weight_decay)
    tp_whole = frozenset(i for i, rep in enumerate(replicated) if rep)
    optimizer = build_shard_optimizer(groups, len(params), optim, group, mp.tp, tp_whole, fused)
    engine = ZeroEngine(model, params, buckets, bucket_of, grad_views, pieces, optimizer, group,
                        parallel.dp_overlap, mp, shared)
    _register_hooks(engine, hook_units)
    return engine
