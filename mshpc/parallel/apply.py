"""The one place a model meets the mesh: each parallelism applied to the plain GPT from outside,
one function each, in torchtitan's order: tensor + sequence parallelism, expert parallelism, then activation
checkpointing (it must wrap the tensor-parallel modules, whose collectives it then recomputes),
then torch.compile of each block (`train.compile`: the graph holds the block as it will run),
then ZeRO data parallelism (it must see the final, sharded parameters).

Every rank builds the whole model from the same seed and keeps its own slices of it, so a split
model starts from exactly the weights the unsplit one would. A pipeline stage model (the
full model's names, some parts removed) goes through the same functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from mshpc.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from mshpc.kernels.dispatch import select_kernels
from mshpc.model.gpt import loss_fn
from mshpc.model.moe import MoE
from mshpc.parallel.compile_blocks import apply_compile
from mshpc.parallel.expert_parallel import TpTokenShards, apply_ep
from mshpc.parallel.mesh import Mesh
from mshpc.parallel.parallel_block import fusable, fuse_parallel_block, log_choice
from mshpc.parallel.tensor import (
    ColumnParallelLinear,
    PartialRowLinear,
    RowParallelLinear,
    SharedInputSlot,
    vocab_parallel_cross_entropy,
)
from mshpc.parallel.tp_split import COLUMNS, GATE_UP_ROWS, ROWS, TpSplit, chunk_bounds, qkv_split
from mshpc.parallel.vocab_embedding import VocabParallelEmbedding
from mshpc.parallel.zero import ModelParallel, ShardDomain, ZeroEngine
from mshpc.parallel.zero3 import block_units
from mshpc.parallel.zero_build import build_zero_engine

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> mean loss
TP_MODULES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, SharedInputSlot, PartialRowLinear)


@dataclass(frozen=True)
class Parallelized:
    engine: ZeroEngine  # engine.model is the (split) model
    loss_fn: LossFn  # the loss of what the split model returns (vocab-parallel logits under tp)


def parallelize(model: nn.Module, mesh: Mesh, *, model_cfg: ModelConfig, parallel: ParallelConfig,
                train: TrainConfig, optim: OptimConfig, tied: frozenset[str] = frozenset()) -> Parallelized:
    """Apply TP/SP, activation checkpointing, compilation and ZeRO to `model`, in that order
    (compilation before checkpointing for a block that is not one graph); `tied`: see apply_zero.
    Collective over the tp and dp groups."""
    device = next(model.parameters()).device
    loss = apply_tp(model, mesh.tp, parallel) if mesh.shape.tp > 1 else loss_fn
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.loss_scale = 1.0 / train.grad_accum  # the router's losses weigh as the model's per micro-batch
        moe.experts.resolve_impl(device.type)
    experts = apply_ep(model, mesh, parallel, train.micro_batch)
    # tp's collectives run between graphs; a MoE block compiles only its attention half, which is
    # one graph at tp = 1 (compile_blocks.compiled_region)
    one_graph = mesh.shape.tp == 1
    if train.compile and not one_graph:
        # torch.compile runs a checkpoint whose body breaks the graph wholly eagerly (dynamo traces
        # a checkpoint as one region or not at all): here the checkpoint wraps the compiled block
        apply_compile(_blocks(model), model_cfg.fused_kernels, device, fullgraph=False)
    apply_activation_checkpointing(model, parallel.activation_checkpointing)
    if train.compile and one_graph:
        apply_compile(_blocks(model), model_cfg.fused_kernels, device, fullgraph=True)
    engine = apply_zero(model, mesh, parallel=parallel, optim=optim, fused_kernels=model_cfg.fused_kernels,
                        compiled=train.compile, tied=tied, domains=() if experts is None else (experts,))
    return Parallelized(engine, loss)


# ---------------------------------------------------------------- tensor + sequence parallelism


def _blocks(model: nn.Module) -> Iterable[Any]:  # Any: their parts get swapped for parallel twins
    layers = getattr(model, "layers", None) or []
    return layers.values() if isinstance(layers, nn.ModuleDict) else layers


def _part(n: int, group: dist.ProcessGroup) -> slice:
    """This rank's near-equal part of range(n) (uneven only for the vocabulary)."""
    lo, hi = chunk_bounds(n, dist.get_world_size(group))[dist.get_rank(group)]
    return slice(lo, hi)


def _local(weight: torch.Tensor, split: TpSplit, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's part of `weight` as `split` cuts it ([q; k; v] for qkv: its heads)."""
    return split.part(weight.detach(), dist.get_rank(group), dist.get_world_size(group))


def apply_tp(model: nn.Module, group: dist.ProcessGroup, parallel: ParallelConfig) -> LossFn:
    """Megatron's split with sequence parallelism: vocab-parallel embedding and lm head (a tied
    weight stays tied: both split the vocabulary alike), qkv and mlp.fc column-parallel (per
    block: [q; k; v] and SwiGLU's [gate; up] keep each rank's parts together),
    attn.proj and mlp.proj row-parallel; norms and dropout see 1/tp of the sequence. Returns the
    loss for the vocab-parallel logits."""
    chunks = parallel.tp_overlap_chunks if parallel.tp_overlap else 1
    tp = dist.get_world_size(group)
    embedding, head = getattr(model, "tok_embeddings", None), getattr(model, "lm_head", None)
    table = embedding if embedding is not None else head  # a middle pipeline stage has neither
    vocab_start = 0 if table is None else _part(table.weight.shape[0], group).start
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    if embedding is not None:
        model.tok_embeddings = vocab = VocabParallelEmbedding(
            _local(embedding.weight, ROWS, group), embedding.weight.shape[0], group)
    if head is not None:
        model.lm_head = lm_head = ColumnParallelLinear(_local(head.weight, ROWS, group), group, chunks)
        if tied:
            lm_head.weight = vocab.weight
    cfg = getattr(model, "cfg", None)
    fused, reason = fusable(cfg is not None and cfg.parallel_block, 0.0 if cfg is None else cfg.dropout,
                            parallel.tp_fused_block)
    log_choice(fused, reason)
    for block in _blocks(model):
        attn, mlp = block.attn, block.mlp
        if isinstance(mlp, MoE):
            # experts are not split by tp: each tp rank routes its own sequence shard (apply_moe_tp)
            apply_moe_tp(block, group, chunks)
            continue
        qkv = qkv_split(attn.n_head, attn.n_kv_head, attn.head_dim)
        fc_split = GATE_UP_ROWS if mlp.gated else ROWS  # swiglu: the gate needs its rank's up rows
        local = {"attn.qkv": (_local(attn.qkv.weight, qkv, group), qkv),
                 "mlp.fc": (_local(mlp.fc.weight, fc_split, group), fc_split),
                 "attn.proj": (_local(attn.proj.weight, COLUMNS, group), COLUMNS),
                 "mlp.proj": (_local(mlp.proj.weight, COLUMNS, group), COLUMNS)}
        # this rank's heads: 1/tp of them, and of the kv heads, or a copy of one when fewer than tp
        attn.n_head, attn.n_kv_head = attn.n_head // tp, max(1, attn.n_kv_head // tp)
        if fused:
            fuse_parallel_block(block, local, group, chunks)
        else:
            _split_block(attn, mlp, local, group, chunks)
    return functools.partial(vocab_parallel_cross_entropy, vocab_start=vocab_start, group=group)


def apply_moe_tp(block: Any, group: dist.ProcessGroup, chunks: int) -> None:
    """A mixture-of-experts block under tp: attention split as Megatron's; the MoE left whole on
    every tp rank, routing the 1/tp sequence shard the rank holds (no collective between the
    norm and the experts), its load statistics summed over the tp group (TpTokenShards)."""
    attn = block.attn
    qkv = qkv_split(attn.n_head, attn.n_kv_head, attn.head_dim)
    tp = dist.get_world_size(group)
    attn.qkv = ColumnParallelLinear(_local(attn.qkv.weight, qkv, group), group, chunks, qkv)
    attn.proj = RowParallelLinear(_local(attn.proj.weight, COLUMNS, group), group, chunks)
    attn.n_head, attn.n_kv_head = attn.n_head // tp, max(1, attn.n_kv_head // tp)
    block.mlp.shards = TpTokenShards(group)


def _split_block(attn: Any, mlp: Any, local: dict[str, tuple[torch.Tensor, TpSplit]],
                 group: dist.ProcessGroup, chunks: int) -> None:
    """Megatron's block: each column-parallel linear gathers its input, each row-parallel one
    reduce-scatters its output (2 + 2 collectives per layer forward)."""
    attn.qkv, mlp.fc = (ColumnParallelLinear(w, group, chunks, split) for w, split in (local["attn.qkv"], local["mlp.fc"]))
    attn.proj = RowParallelLinear(local["attn.proj"][0], group, chunks)
    mlp.proj = RowParallelLinear(local["mlp.proj"][0], group, chunks)


def tp_replicated(model: nn.Module) -> frozenset[str]:
    """Names of the parameters that tensor parallelism left whole on every tp rank (norms)."""
    owners = {id(p) for m in model.modules() if isinstance(m, TP_MODULES) for p in m.parameters()}
    return frozenset(n for n, p in model.named_parameters() if id(p) not in owners)


def tp_copies(model: nn.Module) -> dict[str, torch.Tensor]:
    """For each parameter with rows replicated over tp (kv heads fewer than tp), a mask (its
    shape) of the rows this rank holds a copy of that another rank counts in the clip norm."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, SharedInputSlot)) and any(not c.owner for c in m.copies):
            mask = torch.zeros_like(m.weight, dtype=torch.bool)
            for c in m.copies:
                mask[c.lo:c.hi] = not c.owner
            out[f"{name}.weight"] = mask
    return out


def tp_splits(model: nn.Module) -> dict[str, TpSplit]:
    """How tensor parallelism cut each parameter it split, by name (what resharding needs)."""
    return {f"{name}.weight": m.split for name, m in model.named_modules() if isinstance(m, TP_MODULES)}


# ---------------------------------------------------------------- activation checkpointing


def _recomputed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # Non-reentrant: it restores the RNG state for dropout and works with the ZeRO hooks. No
    # context_fn (torch.compile takes only one that makes TorchDispatchModes): a mixture of
    # experts tells its recomputation from its forward itself (model/moe.py `recomputing`).
    return functools.partial(checkpoint, fn, use_reentrant=False)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """full: keep only each block's input and recompute the block in backward. selective:
    recompute only the attention core (RoPE, softmax(q k^T) v), whose activations grow with s^2
    and cost few FLOPs to redo (Korthikanti et al. 2022 sec. 4.1). The same names the planner
    uses (`parallel.activation_checkpointing`)."""
    for block in _blocks(model):
        if mode == "full":
            block.forward = _recomputed(block.forward)
        elif mode == "selective":
            block.attn.attend = _recomputed(block.attn.attend)


# ---------------------------------------------------------------- data parallelism


def apply_zero(model: nn.Module, mesh: Mesh, *, parallel: ParallelConfig, optim: OptimConfig, fused_kernels: str,
               compiled: bool, tied: frozenset[str] = frozenset(), domains: tuple[ShardDomain, ...] = ()) -> ZeroEngine:
    """ZeRO over the dp group (parallel.zero_stage 2, or 3: each group of blocks a unit); the
    clipping norm is summed over the model-parallel group too. `tied` names a pipeline stage's
    copy of a weight the other embedding stage holds too (the tied embedding): its gradient is
    summed over the mesh's embed group. `fused_kernels` (model.fused_kernels) picks the
    optimizer's kernel; `compiled` (train.compile) blocks hook once each at stage 2; `domains`:
    parameters sharded over a group of their own (an MoE's experts over edp)."""
    replicated = tp_replicated(model) if mesh.shape.tp > 1 else frozenset()
    copies = tp_copies(model) if mesh.shape.tp > 1 else {}
    mp = ModelParallel(tp=mesh.tp, replicated=replicated, norm=mesh.mp, tied=tied, tied_group=mesh.embed,
                       copies=copies)
    # the fused multi-tensor optimizer where the kernels built (chosen once per process, logged)
    fused = select_kernels(fused_kernels).fused
    units = tuple(_blocks(model)) if compiled else ()  # compiled: one hook per block
    layers = getattr(model, "layers", None) or {}
    blocks = block_units([(int(i), b) for i, b in layers.items()], parallel.zero3_blocks_per_unit)
    return build_zero_engine(model, optim, parallel, mesh.dp, mp, fused=fused, hook_units=units, domains=domains,
                             blocks=blocks)
