"""Building the ZeRO engine (zero.py): its buckets, the parameters moved into their flat
buffers, this rank's master shard and pieces, the optimizer over those pieces, and the hooks
that drive the overlap. Each part is a small `build_*` function, in the order they run."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mshpc.config import OptimConfig, ParallelConfig
from mshpc.cpu_ranks.shared_buckets import HostShared, map_buffers
from mshpc.cpu_ranks.tunings import active
from mshpc.errors import ConfigError
from mshpc.optim.optimizer import param_groups
from mshpc.parallel import comm
from mshpc.parallel.buckets import BucketLayout, build_buckets
from mshpc.parallel.sharded_optim import build_shard_optimizer
from mshpc.parallel.zero import (
    DP_ONLY,
    GRAD_DTYPE,
    Bucket,
    ModelParallel,
    ShardDomain,
    ShardPiece,
    ZeroEngine,
)
from mshpc.parallel.zero3 import UnitGathers, Use, build_units, resize


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # ties once
    dtypes = sorted({str(p.dtype) for _, p in named})
    if len(dtypes) > 1:
        raise ConfigError(f"the ZeRO engine needs one parameter dtype; the model has {', '.join(dtypes)} "
                          "(cast the model to one, e.g. model.float())")
    return named


@dataclass(frozen=True)
class BucketPlan:
    """Where a bucket goes: its layout, the domain it belongs to (0: the dp group; d:
    domains[d - 1]) and, at stage 3, its unit (an index into the units in backward order)."""

    layout: BucketLayout
    domain: int
    unit: int = 0


def build_layouts(numels: list[int], tp_replicated: list[bool], tied: list[bool], bucket_numel: int,
                  dps: tuple[int, ...], domain_of: list[int] | None = None,
                  units: list[list[int]] | None = None) -> list[BucketPlan]:
    """Buckets of the parameters tp ranks split, then buckets of those every tp rank holds whole
    (without tensor parallelism: all of them in the first kind). The second kind comes last:
    their reduce-scatters start in bucket order, and the first layer's norm completes them. A
    tied parameter gets a bucket of its own. Parameter i belongs to domain domain_of[i] (default
    all 0), whose group has dps[d] ranks; a bucket holds one domain's parameters, and within a
    kind the domains' buckets interleave in backward order (latest-registered parameters first).
    `units` (stage 3; parameter indices, ascending, each unit in backward order): the same, unit
    by unit, so that no bucket holds two units' parameters."""
    domain_of = domain_of if domain_of is not None else [0] * len(numels)
    plans = []
    for u, members in enumerate(units if units is not None else [list(range(len(numels)))]):
        for kind in (False, True):
            mine = []
            for d, dp in enumerate(dps):
                indices = [i for i in members if tp_replicated[i] == kind and domain_of[i] == d]
                alone = frozenset(k for k, i in enumerate(indices) if tied[i])
                for layout in build_buckets([numels[i] for i in indices], bucket_numel, dp, alone):
                    slots = tuple(dataclasses.replace(slot, index=indices[slot.index]) for slot in layout.slots)
                    mine.append(BucketPlan(dataclasses.replace(layout, slots=slots), d, u))
            plans += sorted(mine, key=lambda plan: -min(slot.index for slot in plan.layout.slots))  # stable
    return plans


def build_bucket_buffers(
    params: list[nn.Parameter], plans: list[BucketPlan], groups: tuple[dist.ProcessGroup | None, ...],
    tp_replicated: list[bool], tied: list[bool], shared: tuple[HostShared | None, ...], stage: int = 2,
) -> list[Bucket]:
    """Move each parameter into its bucket's flat buffer (the parameter becomes a view), make
    every rank's parameters those of its domain group's first rank, and cut this rank's fp32
    master shard. Collective over each domain's group (a broadcast per bucket). With
    shared[d], domain d's k-th bucket's parameters and gradients are its buffers 2k and 2k + 1
    (map_shared_buckets' order). At `stage` 3 the gradient shard is a tensor of its own."""
    buckets: list[Bucket] = []
    for k, plan in enumerate(plans):
        layout, group, mapped = plan.layout, groups[plan.domain], shared[plan.domain]
        index = 2 * sum(1 for q in plans[:k] if q.domain == plan.domain)  # this bucket's place in `mapped`
        p0 = params[layout.slots[0].index]
        if mapped is not None:
            flat, grads = mapped.local[index], mapped.local[index + 1]  # zeroed when mapped
        else:
            flat = torch.zeros(layout.numel, dtype=p0.dtype, device=p0.device)
            grads = torch.empty(layout.numel, dtype=GRAD_DTYPE, device=p0.device)
            if stage == 3:  # allocated from a unit's first gradient to its reduce-scatter (zero3.py)
                resize(grads, 0)
            else:
                grads.zero_()
        for slot in layout.slots:
            p = params[slot.index]
            flat[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            p.data = flat[slot.offset:slot.offset + slot.numel].view(p.shape)
        # DDP's rule: start from one replica's weights, whatever each rank initialised
        comm.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        rank = dist.get_rank(group)
        lo = rank * layout.shard_numel
        master = flat[lo:lo + layout.shard_numel].to(torch.float32, copy=True)
        if stage == 3:  # the shard is all this rank keeps; the units are gathered per use
            shard_grad = torch.zeros(layout.shard_numel, dtype=GRAD_DTYPE, device=p0.device)
            resize(flat, 0)
        else:
            shard_grad = grads[lo:lo + layout.shard_numel]
        first = layout.slots[0].index
        buckets.append(Bucket(layout, flat, grads, master, shard_grad, rank, group, tp_replicated[first],
                              tied[first], mapped, index))
    return buckets


def map_shared_buckets(params: list[nn.Parameter], plans: list[BucketPlan], parallel: ParallelConfig,
                       group: dist.ProcessGroup | None, domain: int) -> HostShared | None:
    """The buffers of the buckets of `domain` (over `group`) in memory the group's ranks all map
    (cpu_ranks/shared_buckets.py), where that helps and works: CPU ranks (chosen at start-up),
    more than one rank, all on this host, stage 2. Collective over `group`."""
    if parallel.zero_stage == 3:  # its buffers come and go; a mapped file would hold them all
        return None
    if not (parallel.dp_shared_memory and active().shared_buckets and dist.get_world_size(group) > 1):
        return None
    specs = [spec for plan in plans if plan.domain == domain
             for spec in ((plan.layout.numel, params[plan.layout.slots[0].index].dtype),
                          (plan.layout.numel, GRAD_DTYPE))]
    return map_buffers(specs, group)


def build_grad_views(params: list[nn.Parameter], buckets: list[Bucket]) -> list[torch.Tensor]:
    """Each parameter's fp32 gradient inside its bucket, where its hook copies or adds what
    autograd computed (ZeroEngine._on_grad); .grad itself stays None. A view needs the storage
    it indexes: a freed bucket (stage 3) gets it back while its views are cut, one at a time."""
    views: list[torch.Tensor] = [torch.empty(0)] * len(params)
    for bucket in buckets:
        freed = bucket.grads.untyped_storage().nbytes() == 0
        if freed:
            resize(bucket.grads, bucket.grads.numel())
        for slot in bucket.layout.slots:
            p = params[slot.index]
            views[slot.index] = bucket.grads[slot.offset:slot.offset + slot.numel].view(p.shape)
            p.grad = None
        if freed:
            resize(bucket.grads, 0)
    return views


def build_shard_pieces(
    named: list[tuple[str, nn.Parameter]], buckets: list[Bucket], mp: ModelParallel,
    placement: Mapping[str, tuple[tuple[int, ...], int]],
) -> list[ShardPiece]:
    """This rank's part of every parameter, as views into the master shards, each with its
    .grad a view into the reduced gradient shard, and its checkpoint key; a parameter in
    `placement` (a domain's) is a piece of the whole tensor placed there."""
    pieces = []
    for bucket in buckets:
        shard_grad = bucket.shard_grad
        for piece in bucket.layout.pieces(bucket.rank):
            name, p = named[piece.index]
            span = slice(piece.shard_offset, piece.shard_offset + piece.numel)
            tensor = bucket.master[span]
            tensor.grad = shard_grad[span]
            saved = mp.tp_rank == 0 or not bucket.tp_replicated
            copies = mp.copies.get(name)
            uncounted = None if copies is None else copies.reshape(-1)[piece.param_start:piece.param_start + piece.numel]
            shape, offset = placement.get(name, (tuple(p.shape), 0))
            pieces.append(ShardPiece(name, shape, offset + piece.param_start, tensor, mp.checkpoint_key(name), saved,
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
    """Gradient hooks per parameter; at stage 2, forward pre-hooks that wait for a module's
    all-gathered weights, per module, or once per unit (a compiled block) for everything inside
    it: a hook inside a compiled graph would be traced, and its wait on a collective cannot be.
    (Stage 3's units hook their modules themselves: zero3.UnitGathers.register.)"""
    for i, p in enumerate(engine.params):
        p.register_post_accumulate_grad_hook(lambda _, i=i: engine._on_grad(i))
    if engine.units is not None:
        return
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


def check_domains(named: list[tuple[str, nn.Parameter]], domains: tuple[ShardDomain, ...], mp: ModelParallel) -> None:
    """Each domain's parameters exist, belong to no other domain and are not tied, and each one's
    placement fits its whole tensor."""
    params = dict(named)
    seen: set[str] = set()
    for domain in domains:
        for name in sorted(domain.names):
            if name not in params or name in seen or name in mp.tied:
                why = ("is not a trainable parameter" if name not in params
                       else "is in two domains" if name in seen else "is tied to another stage's copy")
                raise ConfigError(f"ZeRO shard domain: {name} {why} (a domain names untied trainable "
                                  "parameters of model.named_parameters(), each in one domain)")
            seen.add(name)
            shape, offset = domain.placement.get(name, (tuple(params[name].shape), 0))
            if offset < 0 or offset + params[name].numel() > math.prod(shape):
                raise ConfigError(f"ZeRO shard domain: {name} ({params[name].numel()} elements) placed at "
                                  f"offset {offset} does not fit its whole shape {shape}")


def build_zero_engine(
    model: nn.Module, optim: OptimConfig, parallel: ParallelConfig, group: dist.ProcessGroup | None = None,
    mp: ModelParallel = DP_ONLY, fused: bool = False, hook_units: tuple[nn.Module, ...] = (),
    domains: tuple[ShardDomain, ...] = (), blocks: tuple[tuple[nn.Module, ...], ...] = (),
) -> ZeroEngine:
    """Apply ZeRO data parallelism (parallel.zero_stage 2 or 3) to `model` (already on its
    device) over the dp `group` (None: the world), with the optimizer named by `optim` (its
    multi-tensor kernel version when `fused`); `mp` says how the model is split besides; each of
    `hook_units` (compiled blocks) waits for its weights as a whole at stage 2; `domains` are
    sharded over groups of their own; `blocks`: the model's transformer blocks in forward order,
    grouped into stage 3's units (zero3.block_units). Collective over the dp group and every
    domain's group."""
    named = _trainable(model)
    check_domains(named, domains, mp)
    params = [p for _, p in named]
    groups = (group, *(d.group for d in domains))
    domain_of = [next((d + 1 for d, dom in enumerate(domains) if name in dom.names), 0) for name, _ in named]
    bucket_numel = max(1, int(parallel.bucket_mb * 2**20) // GRAD_DTYPE.itemsize)  # MiB of fp32 grads
    replicated = [mp.tp_size > 1 and name in mp.replicated for name, _ in named]
    tied = [name in mp.tied for name, _ in named]
    units, uses = build_units(model, named, blocks) if parallel.zero_stage == 3 else (None, [])
    if units is not None:  # in backward order (reduce-scatters start in bucket order); one bucket a unit
        units = units[::-1]
        uses = [dataclasses.replace(use, unit=len(units) - 1 - use.unit) for use in uses]
        bucket_numel = max(1, sum(p.numel() for p in params))
    plans = build_layouts([p.numel() for p in params], replicated, tied, bucket_numel,
                          tuple(dist.get_world_size(g) for g in groups), domain_of, units)
    shared = tuple(map_shared_buckets(params, plans, parallel, g, d) for d, g in enumerate(groups))
    buckets = build_bucket_buffers(params, plans, groups, replicated, tied, shared, parallel.zero_stage)
    bucket_of = [0] * len(params)
    for b, plan in enumerate(plans):
        for slot in plan.layout.slots:
            bucket_of[slot.index] = b
    grad_views = build_grad_views(params, buckets)
    placement = {name: where for d in domains for name, where in d.placement.items()}
    pieces = build_shard_pieces(named, buckets, mp, placement)
    opt_groups = build_piece_groups(model, named, pieces, optim.weight_decay)
    tp_whole = frozenset(i for i, rep in enumerate(replicated) if rep)
    norm_domains = tuple((d.group, frozenset(i for i, of in enumerate(domain_of) if of == k + 1))
                         for k, d in enumerate(domains))
    optimizer = build_shard_optimizer(opt_groups, len(params), optim, group, mp.tp, tp_whole, fused, norm_domains)
    gathers = None
    if units is not None:
        unit_buckets = [tuple(b for b, plan in enumerate(plans) if plan.unit == u) for u in range(len(units))]
        gathers = build_unit_gathers(buckets, unit_buckets, uses, parallel)
    engine = ZeroEngine(model, params, buckets, bucket_of, grad_views, pieces, optimizer, group,
                        parallel.dp_overlap, mp, gathers)
    _register_hooks(engine, hook_units)
    return engine


def build_unit_gathers(buckets: list[Bucket], unit_buckets: list[tuple[int, ...]], uses: list[Use],
                       parallel: ParallelConfig) -> UnitGathers:
    """Stage 3's units over the built buckets (their storage freed: the first forward gathers
    what it needs), their hooks registered."""
    gathers = UnitGathers(buckets, unit_buckets, uses, parallel.dp_overlap, parallel.reshard_after_forward)
    gathers.register()
    return gathers
