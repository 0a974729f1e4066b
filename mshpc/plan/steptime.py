"""Predicted step time and MFU of a layout.

Compute is the model's FLOPs (Narayanan et al. 2021 sec. 5.1, as mshpc.diagnose.mfu counts
them) plus what recomputation repeats, at the device's GEMM efficiency. Each collective costs
its bytes times nccl-tests' bus-bandwidth factor over the link it crosses. The pipeline runs
(m + (p - 1)/v) micro-batch slots of its slowest stage (Narayanan et al. 2021 sec. 2.2: bubble
(p - 1)/(v m) of the ideal time). Overlap hides what the engine overlaps: the ZeRO
reduce-scatter behind the last micro-batch's backward and the all-gather behind the first
forward (MegaScale sec. 3.2), sequence-parallel collectives behind the neighbouring GEMMs in
parallel.tp_overlap_chunks chunks when parallel.tp_overlap is on (all but the first chunk, and
no more than the GEMMs last), and pipeline send/recv behind
compute in the steady state (decoupled send/recv), leaving the fill and drain transfers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mshpc.config import ModelConfig, ParallelConfig
from mshpc.diagnose.mfu import attention_context, flops_per_token
from mshpc.parallel.parallel_block import fusable
from mshpc.plan.devices import DeviceSpec
from mshpc.plan.layout import Layout
from mshpc.plan.memory import GRAD_BYTES, WEIGHT_BYTES, sharded_params, stage_expert_params, stage_params
from mshpc.plan.moe_plan import ep_exposed_s, ep_link_gbps, expert_fraction

# Optimizer step bytes per sharded parameter: read master, grad and two moments, write three.
OPTIMIZER_BYTES = 7 * 4


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by where they go."""

    compute_s: float  # the pipeline's busy slots, recomputation included
    bubble_s: float
    tp_s: float  # exposed tensor/sequence-parallel communication
    pp_s: float  # exposed pipeline send/recv
    dp_s: float  # exposed ZeRO reduce-scatter + all-gather
    ep_s: float  # exposed all-to-all of a mixture of experts' dispatch and combine
    optimizer_s: float
    mfu: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_s + self.pp_s + self.dp_s + self.ep_s + self.optimizer_s

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.total_s


def bubble_fraction(pp: int, n_micro: int, virtual_stages: int = 1) -> float:
    """Idle share of a pipeline step: (p - 1)/(m + p - 1) for 1F1B and GPipe, (p - 1)/(v m + p - 1)
    interleaved (Narayanan et al. 2021 sec. 2.2: bubble time (p - 1)/v slots against m busy)."""
    return (pp - 1) / (virtual_stages * n_micro + pp - 1)


def _per_token_flops(m: ModelConfig) -> tuple[float, float]:
    """(per layer, logits) training FLOPs per token; flops_per_token is L * layer + logits."""
    logits = flops_per_token(dataclasses.replace(m, n_layer=0))
    return (flops_per_token(m) - logits) / m.n_layer, logits


def _recompute_flops(m: ModelConfig, checkpointing: str, layer: float) -> float:
    """Extra FLOPs per token and layer that recomputation repeats: the whole forward (a third
    of forward + backward) for full, the attention core's forward (QK^T and AV, 4 s h) for
    selective (Korthikanti et al. 2022 sec. 4)."""
    if checkpointing == "full":
        return layer / 3
    if checkpointing == "selective":
        return 4.0 * attention_context(m) * m.d_model
    return 0.0


def _collective_s(nbytes: float, size: int, factor: float, gbps: float) -> float:
    """nccl-tests: time = bytes * busbw factor / busbw, factor (n-1)/n for all-gather and
    reduce-scatter, 1 for send/recv."""
    return 0.0 if size == 1 else nbytes * factor / (gbps * 1e9)


def stage_compute_s(m: ModelConfig, layout: Layout, dev: DeviceSpec) -> float:
    """Forward + backward of one micro-batch on the slowest (last: it has the logits) stage."""
    layer, logits = _per_token_flops(m)
    per_token = m.n_layer / layout.pp * (layer + _recompute_flops(m, layout.checkpointing, layer)) + logits
    return layout.micro_batch * m.seq_len * per_token / layout.tp / (dev.peak_tflops * 1e12 * dev.gemm_efficiency)


def tp_collectives_per_layer(m: ModelConfig, checkpointing: str, fused_block: bool = True) -> int:
    """Sequence-parallel collectives of (b, s, h) one layer issues per micro-batch, as the engine
    does (parallel/tensor.py; tests/dist/plan counts them from the flight recorder). Serial block
    (Megatron): forward 2 all-gathers + 2 reduce-scatters; backward 2 all-gathers of the saved
    input shards again, 2 of the output gradients and 2 reduce-scatters of the input gradients.
    Fused parallel block (parallel/parallel_block.py): half of each. Full recomputation repeats
    the forward's."""
    forward = 2 if fusable(m.parallel_block, m.dropout, fused_block)[0] else 4
    backward = 3 * forward // 2
    return forward * (2 if checkpointing == "full" else 1) + backward


def tp_exposed_s(m: ModelConfig, parallel: ParallelConfig, layout: Layout, dev: DeviceSpec, compute_s: float) -> float:
    """Sequence-parallel all-gathers and reduce-scatters of one micro-batch on one stage
    (`tp_collectives_per_layer` per layer), minus what the chunked overlap hides."""
    t = layout.tp
    per_layer = tp_collectives_per_layer(m, layout.checkpointing, parallel.tp_fused_block)
    nbytes = layout.micro_batch * m.seq_len * m.d_model * dev.act_bytes
    comm = m.n_layer / layout.pp * per_layer * _collective_s(nbytes, t, (t - 1) / t, dev.intra_gbps)
    if not parallel.tp_overlap:
        return comm
    return max(comm / parallel.tp_overlap_chunks, comm - compute_s)


def _dp_link_gbps(layout: Layout, dev: DeviceSpec, gpus_per_node: int) -> float:
    # dp peers are tp ranks apart (tp innermost): inside one node only while tp * dp fits in it
    return dev.intra_gbps if layout.tp * layout.dp <= gpus_per_node else dev.inter_gbps


def weight_gathers(parallel: ParallelConfig, layout: Layout) -> int:
    """All-gathers of every weight per step: one at stage 2 (after the update); at stage 3 one
    per micro-batch for forward and, with reshard_after_forward, one more for backward."""
    if layout.zero_stage == 2:
        return 1
    return layout.n_micro * (2 if parallel.reshard_after_forward else 1)


def dp_bytes(layout: Layout, *, model_cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """Bytes a dp group's collectives carry per step (each counted once, as the flight recorder
    counts them): the gradients' reduce-scatter and the weights' all-gathers; at stage 3 with one
    micro-batch, 1.5x stage 2's."""
    params = max(stage_params(model_cfg, layout, s) for s in {0, layout.pp - 1})
    return params * (GRAD_BYTES + WEIGHT_BYTES * weight_gathers(parallel, layout)) if layout.dp > 1 else 0.0


def dp_exposed_s(m: ModelConfig, parallel: ParallelConfig, layout: Layout, dev: DeviceSpec, gpus_per_node: int,
                 mb_s: float) -> float:
    """ZeRO per step: reduce-scatter of the fp32 gradients behind the last backward, all-gathers
    of the weights behind compute: stage 2's one behind the first forward, stage 3's one behind
    every forward (a unit's gather behind the unit before it) and one behind every backward. The
    routed experts' collectives run over their dp / ep ranks, the rest over dp."""
    experts = stage_expert_params(m, layout)
    params = max(stage_params(m, layout, s) for s in {0, layout.pp - 1}) - experts
    gbps, n, e = _dp_link_gbps(layout, dev, gpus_per_node), layout.dp, layout.dp // layout.ep
    rs = _collective_s(params * GRAD_BYTES, n, (n - 1) / n, gbps) + _collective_s(experts * GRAD_BYTES, e, (e - 1) / e, gbps)
    ag = _collective_s(params * WEIGHT_BYTES, n, (n - 1) / n, gbps) + _collective_s(experts * WEIGHT_BYTES, e, (e - 1) / e, gbps)
    gathers = weight_gathers(parallel, layout)
    if not parallel.dp_overlap:
        return rs + gathers * ag
    exposed = max(0.0, rs - mb_s * 2 / 3) + max(0.0, ag - mb_s / 3)  # stage 2's gather: behind the first forward
    if layout.zero_stage == 3:  # a gather per micro-batch behind each forward, one behind each backward
        backward = max(0.0, ag - mb_s * 2 / 3) if parallel.reshard_after_forward else 0.0
        exposed += (layout.n_micro - 1) * max(0.0, ag - mb_s / 3) + layout.n_micro * backward
    return exposed


def pp_exposed_s(m: ModelConfig, layout: Layout, dev: DeviceSpec, gpus_per_node: int) -> float:
    """Fill and drain: every model-chunk boundary is crossed once by the first forward and once
    by the last backward; a transfer is one micro-batch's sequence-parallel activation shard."""
    if layout.pp == 1:
        return 0.0
    nbytes = layout.micro_batch * m.seq_len * m.d_model * dev.act_bytes / layout.tp
    # stage neighbours are dp * tp ranks apart
    gbps = dev.intra_gbps if layout.dp * layout.tp * layout.pp <= gpus_per_node else dev.inter_gbps
    return 2 * (layout.pp * layout.virtual_stages - 1) * _collective_s(nbytes, 2, 1.0, gbps)


def step_time(layout: Layout, dev: DeviceSpec, gpus_per_node: int, *, model_cfg: ModelConfig,
              parallel: ParallelConfig) -> StepTime:
    """One optimizer step of `model_cfg` at `layout`, by part; `parallel`: the overlap settings."""
    m = model_cfg
    compute = stage_compute_s(m, layout, dev)
    tp_s = tp_exposed_s(m, parallel, layout, dev, compute)
    ep_link = ep_link_gbps(layout, dev.intra_gbps, dev.inter_gbps, gpus_per_node)
    ep_s = ep_exposed_s(m, layout, ep_link, dev.act_bytes, parallel.ep_overlap_chunks if parallel.ep_overlap else 1,
                        compute * expert_fraction(m))
    mb_s = compute + tp_s + ep_s
    params = max(stage_params(m, layout, s) for s in {0, layout.pp - 1})
    parts = dict(
        compute_s=layout.n_micro * compute,
        bubble_s=(layout.pp - 1) / layout.virtual_stages * mb_s,
        tp_s=layout.n_micro * tp_s,
        pp_s=pp_exposed_s(m, layout, dev, gpus_per_node),
        dp_s=dp_exposed_s(m, parallel, layout, dev, gpus_per_node, mb_s),
        ep_s=layout.n_micro * ep_s,
        optimizer_s=sharded_params(m, layout, params) * OPTIMIZER_BYTES / (dev.hbm_gbps * 1e9),
    )
    total = sum(parts.values())
    sequences = layout.dp * layout.micro_batch * layout.n_micro  # the global batch
    model_flops = flops_per_token(m) * sequences * m.seq_len
    return StepTime(**parts, mfu=model_flops / (total * layout.gpus * dev.peak_tflops * 1e12))
