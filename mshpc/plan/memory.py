"""Memory per GPU of a layout: weights, gradients, ZeRO-sharded optimizer state, activations.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), sec. 4: per layer and micro-batch, with tensor and sequence parallelism,
sbh(34/t + 5as/(ht)) bytes of 16-bit activations for a serial block with dropout (eq. 2 and
Table 2), where 34 sbh = attention 11 (qkv input 2, q and k 4, v 2, projection input 2, dropout
mask 1) + MLP 19 (fc input 2, GeLU input 8, GeLU output 8, dropout mask 1) + two norms 4, and
5as^2b the attention scores, their dropout mask and output. The planner counts mshpc's block:
MLP width r*h instead of 4h, one norm and one shared input in the parallel block, no dropout
masks when model.dropout is 0, and no score matrix where attention runs fused (SDPA's flash
kernels keep O(s) statistics only). Selective recomputation drops the score terms (sec. 4.2);
full recomputation keeps each layer's input, 2sbh/t, plus one layer's activations while it is
recomputed. In the pipeline, stage i of p holds min(m, p - i) micro-batches under 1F1B, and
2(p - i - 1) + (v - 1)p + 1 model chunks under the interleaved schedule (Megatron-LM's warm-up
counts), so the first stage holds L(1 + (p - 1)/(pv)) layers' worth (Korthikanti sec. 4.2.3).
"""

from __future__ import annotations

from dataclasses import dataclass

from mshpc.config import ModelConfig
from mshpc.diagnose.mfu import block_matrix_params
from mshpc.plan.layout import Layout

GIB = 2**30
# mshpc's ZeRO-2 engine per parameter: fp32 weights (autocast computes in bf16) and fp32
# gradient buckets on every rank; fp32 master and two moments (AdamW, LAMB) on 1/dp of them.
WEIGHT_BYTES, GRAD_BYTES, SHARDED_STATE_BYTES = 4, 4, 12
RESERVED_GIB = 2.0  # CUDA context, NCCL buffers, allocator slack


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the fullest pipeline stage."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    stage: int  # which stage is the fullest

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + RESERVED_GIB * GIB


def _norm_params(m: ModelConfig) -> int:
    return m.d_model * (2 if m.norm == "layernorm" else 1)


def layer_params(m: ModelConfig, tp: int = 1) -> float:
    """One block's parameters on one tp rank: the matrices (mfu.block_matrix_params) are split
    over tp, except that with fewer kv heads than tp ranks each rank keeps one whole kv head
    (Megatron's replication of grouped-query kv heads); the norms are replicated."""
    kv = 2 * m.d_model * m.kv_heads * (m.d_model // m.n_head)  # k and v
    kv_per_rank = kv / min(tp, m.kv_heads)
    return (block_matrix_params(m) - kv) / tp + kv_per_rank + _norm_params(m) * (1 if m.parallel_block else 2)


def stage_params(m: ModelConfig, layout: Layout, stage: int) -> float:
    """Parameters one GPU of pipeline `stage` holds: its layers, the (vocab-parallel)
    embedding on the first stage, the final norm and lm head on the last. A tied lm head is
    the embedding itself at pp = 1 and a synchronised copy on the last stage otherwise."""
    n = layer_params(m, layout.tp) * m.n_layer / layout.pp
    table = m.vocab_size * m.d_model / layout.tp
    last = stage == layout.pp - 1
    if stage == 0:
        n += table
    if last:
        n += _norm_params(m)
        if not m.tie_embeddings or layout.pp > 1:
            n += table
    return n


def layer_activation_bytes(m: ModelConfig, layout: Layout, flash: bool = True) -> float:
    """Bytes of bf16 activations one block stores for one micro-batch on one tp rank
    (sequence-parallel), as the module docstring counts them (Korthikanti et al. 2022 eq. 2)."""
    s, b, h, a, t, r = m.seq_len, layout.micro_batch, m.d_model, m.n_head, layout.tp, m.mlp_ratio
    mask = 1 if m.dropout > 0 else 0
    attention = 10 + mask
    mlp = 2 + 4 * r + mask
    norms = 2 if m.parallel_block else 4
    shared_input = 2 if m.parallel_block else 0  # attention and MLP read one normed tensor
    per_sbh = attention + mlp + norms - shared_input
    scores = 0 if flash or layout.checkpointing != "none" else 5 * a * s * s * b
    return (per_sbh * s * b * h + scores) / t


def in_flight_layers(m: ModelConfig, layout: Layout, stage: int) -> float:
    """Layers' worth of micro-batch activations pipeline `stage` holds at its peak."""
    p, v = layout.pp, layout.virtual_stages
    if v == 1:
        return min(layout.n_micro, p - stage) * m.n_layer / p
    chunks = min(layout.n_micro * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return chunks * m.n_layer / (p * v)


def stage_activation_bytes(m: ModelConfig, layout: Layout, stage: int, flash: bool = True) -> float:
    s, b, h, t = m.seq_len, layout.micro_batch, m.d_model, layout.tp
    per_layer = layer_activation_bytes(m, layout, flash)
    layers = in_flight_layers(m, layout, stage)
    if layout.checkpointing == "full":
        # each layer keeps its input; the one being recomputed holds all of its activations
        acts = layers * 2 * s * b * h / t + per_layer
    else:
        acts = layers * per_layer
    if stage == layout.pp - 1:
        # final norm input and the logits: bf16 out of the lm head, fp32 log-softmax for the loss
        acts += (2 * s * b * h + 6 * s * b * m.vocab_size) / t
    return acts


def memory(m: ModelConfig, layout: Layout, flash: bool = True) -> Memory:
    """Memory of the fullest stage (the first or the last) for `layout`."""
    best = None
    for stage in sorted({0, layout.pp - 1}):
        params = stage_params(m, layout, stage)
        candidate = Memory(
            weights=params * WEIGHT_BYTES, grads=params * GRAD_BYTES,
            optimizer=params * SHARDED_STATE_BYTES / layout.dp,
            activations=stage_activation_bytes(m, layout, stage, flash), stage=stage,
        )
        if best is None or candidate.total > best.total:
            best = candidate
    assert best is not None
    return best
