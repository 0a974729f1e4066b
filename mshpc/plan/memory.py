"""Memory per GPU of a layout: weights, gradients, ZeRO-sharded optimizer state, activations.

Activations are what mshpc's blocks save for backward, term by term (`layer_activation_terms`),
each term measured (plan/saved_activations.py; tests/unit/plan and tests/dist/plan hold the
formula to the measured bytes within 5% at tp 1, 2, 4, every recomputation mode, with document
masks and sliding windows). They follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") sec. 4, whose serial block with dropout keeps
sbh(34/t + 5as/(ht)) bytes of 16-bit activations per layer (eq. 2, `korthikanti_layer_bytes`),
with mshpc's differences: the residual stream (each norm's input) is fp32 under bf16 autocast;
the MLP is r*h wide (2 * ffn into SwiGLU), k and v have n_kv_head heads (under tp each rank
keeps whole copies of them where there are fewer than tp); the parallel block has one norm and one shared input; no dropout masks
when model.dropout is 0; no score matrix where attention runs fused (SDPA's flash kernels keep
a logsumexp per head and token), but SDPA's additive copy of a document or window mask. Selective
recomputation drops what the attention core makes (sec. 4.2); full recomputation keeps each
layer's input plus one layer's activations while it is recomputed. In the pipeline, stage i of p
holds min(m, p - i) micro-batches under 1F1B, all m under GPipe, and 2(p - i - 1) + (v - 1)p + 1
model chunks under the interleaved schedule (Megatron-LM's warm-up counts), so the first stage
holds L(1 + (p - 1)/(pv)) layers' worth (Korthikanti sec. 4.2.3).

At ZeRO stage 3 (parallel/zero3.py) a rank keeps only its fp32 shards of the weights (the
masters, counted with the optimizer's state) and holds whole only the units gathered at once: the
one computing and the next on its way, the largest two neighbours in the order of use (all of
them with reshard_after_forward off, at the end of forward). Gradients live in a unit's buffer
from its backward to its reduce-scatter (those two units and, at worst, the largest one: the tied
embedding's waits for the whole backward), plus the reduced fp32 shard; with gradient
accumulation every buffer stays from the first micro-batch to the last, as at stage 2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mshpc.config import ModelConfig
from mshpc.diagnose.mfu import block_matrix_params
from mshpc.plan.layout import Layout
from mshpc.plan.moe_plan import local_expert_params, moe_mlp_terms

GIB = 2**30
# mshpc's ZeRO-2 engine per parameter: fp32 weights (autocast computes in bf16) and fp32
# gradient buckets on every rank; fp32 master and two moments (AdamW, LAMB) on 1/dp of them.
WEIGHT_BYTES, GRAD_BYTES, SHARDED_STATE_BYTES = 4, 4, 12
MASTER_BYTES = 4  # of SHARDED_STATE_BYTES: the fp32 master, all stage 3 keeps of a weight between uses
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
    kv = 2 * m.d_model * m.kv_heads * m.head_size  # k and v
    kv_per_rank = kv / min(tp, m.kv_heads)
    qk_norms = 2 * m.head_size if m.qk_norm else 0
    return (block_matrix_params(m) - kv) / tp + kv_per_rank + _norm_params(m) * (1 if m.parallel_block else 2) + qk_norms


def stage_expert_params(m: ModelConfig, layout: Layout) -> float:
    """The routed experts' weights one GPU of a stage holds (n_experts / ep per MoE layer), the
    stage's even share of the MoE layers; their ZeRO state is sharded over dp / ep ranks."""
    return local_expert_params(m, layout.ep) * m.moe_layers / layout.pp


def sharded_params(m: ModelConfig, layout: Layout, params: float) -> float:
    """One GPU's ZeRO shard of a stage's `params`: the routed experts' over their dp / ep ranks
    (the expert-data-parallel group), the rest over dp."""
    experts = stage_expert_params(m, layout)
    return (params - experts) / layout.dp + experts / (layout.dp // layout.ep)


def block_params(m: ModelConfig, layout: Layout, moe: bool) -> float:
    """One block on one GPU: a dense block (layer_params) or an MoE block, whose MLP is a router,
    shared experts (whole on every tp rank, as the experts) and the n_experts / ep local experts."""
    dense = layer_params(dataclasses.replace(m, moe=None), layout.tp)
    if not moe or m.moe is None:
        return dense
    h = m.d_model
    mlp = (3 if m.mlp == "swiglu" else 2) * h * m.ffn_width / layout.tp
    rest = m.moe.n_experts * h + 3 * h * m.shared_ffn + (h if m.moe.shared_expert_gate else 0)
    return dense - mlp + rest + local_expert_params(m, layout.ep)


def _layers_params(m: ModelConfig, layout: Layout) -> float:
    """One GPU's share of a stage's layers: an even share of the dense and the MoE blocks."""
    moe = m.moe_layers
    return ((m.n_layer - moe) * block_params(m, layout, False) + moe * block_params(m, layout, True)) / layout.pp


def stage_units(m: ModelConfig, layout: Layout, stage: int, blocks_per_unit: int = 1) -> list[float]:
    """Stage 3's units on one GPU of pipeline `stage` in the order the forward uses them, in
    parameters: the embedding on the first stage, each group of `blocks_per_unit` blocks of a
    pipeline chunk (chunk c of stage s holds layers from (c * pp + s) * chunk), the final norm and
    lm head on the last; the tied embedding at pp = 1 is one unit with the final norm, used first
    and last."""
    chunk = m.n_layer // (layout.pp * layout.virtual_stages)
    units: list[float] = []
    for c in range(layout.virtual_stages):
        start = (c * layout.pp + stage) * chunk
        blocks = [block_params(m, layout, m.is_moe_layer(i)) for i in range(start, start + chunk)]
        units += [sum(blocks[i:i + blocks_per_unit]) for i in range(0, chunk, blocks_per_unit)]
    table = m.vocab_size * m.d_model / layout.tp
    if layout.pp == 1 and m.tie_embeddings:
        return [table + _norm_params(m), *units, table + _norm_params(m)]
    first = [table] if stage == 0 else []
    last = [table + _norm_params(m)] if stage == layout.pp - 1 else []
    return first + units + last


def zero3_gathered_params(m: ModelConfig, layout: Layout, stage: int, blocks_per_unit: int = 1,
                          reshard: bool = True) -> float:
    """Parameters gathered whole at once at stage 3: the largest two neighbours in the order of
    use (one computing, the next on its way), or, with parallel.reshard_after_forward off, every
    weight of the stage."""
    if not reshard:
        return stage_params(m, layout, stage)
    units = stage_units(m, layout, stage, blocks_per_unit)
    return max((a + b for a, b in zip(units, units[1:], strict=False)), default=sum(units))


def zero3_param_bytes(m: ModelConfig, layout: Layout, stage: int = 0, blocks_per_unit: int = 1,
                      reshard: bool = True, weight_bytes: int = WEIGHT_BYTES) -> float:
    """Parameter bytes a GPU of pipeline `stage` holds at its peak at stage 3: its fp32 shards
    (the masters) plus the units gathered at once, in the weights' dtype."""
    return (MASTER_BYTES * sharded_params(m, layout, stage_params(m, layout, stage))
            + weight_bytes * zero3_gathered_params(m, layout, stage, blocks_per_unit, reshard))


def stage_params(m: ModelConfig, layout: Layout, stage: int) -> float:
    """Parameters one GPU of pipeline `stage` holds: its layers, the (vocab-parallel)
    embedding on the first stage, the final norm and lm head on the last. A tied lm head is
    the embedding itself at pp = 1 and a synchronised copy on the last stage otherwise."""
    n = _layers_params(m, layout)
    table = m.vocab_size * m.d_model / layout.tp
    last = stage == layout.pp - 1
    if stage == 0:
        n += table
    if last:
        n += _norm_params(m)
        if not m.tie_embeddings or layout.pp > 1:
            n += table
    return n


RESIDUAL_BYTES = 4  # the residual stream has the weights' dtype (fp32) under bf16 autocast too
STAT_BYTES = 4  # per-token fp32 statistics: a norm's rstd, attention's logsumexp per head
ACT_BYTES = 2  # bf16 autocast (the GPU's dtype: "auto")


def korthikanti_layer_bytes(m: ModelConfig, layout: Layout) -> float:
    """Korthikanti et al. 2022 eq. 2 with sequence parallelism, the paper's serial block:
    sbh (34/t + 5as/(ht)) bytes, scores dropped by selective recomputation (sec. 4.2)."""
    s, b, h, a, t = m.seq_len, layout.micro_batch, m.d_model, m.n_head, layout.tp
    scores = 5 * a * s * s * b if layout.checkpointing == "none" else 0
    return (34 * s * b * h + scores) / t


def layer_activation_terms(m: ModelConfig, layout: Layout, flash: bool = True, documents: bool = False,
                           window_kernel: bool = True, act_bytes: int = ACT_BYTES) -> dict[str, float]:
    """What one block saves for backward per micro-batch on one tp rank, in bytes, by what each
    term holds (measured: plan/saved_activations.py). Under sequence parallelism every term but
    the attention masks is a 1/tp share. `flash`: fused attention (no s x s scores);
    `documents`: packed documents (a document mask); `window_kernel`: FlashAttention's own
    sliding window (CUDA) rather than SDPA with a mask; `act_bytes`: 2 under bf16 autocast."""
    s, b, h, a, t = m.seq_len, layout.micro_batch, m.d_model, m.n_head, layout.tp
    tokens, e, hd = s * b / t, act_bytes, m.head_size
    norms = 1 if m.parallel_block else 2
    kv = kv_heads_per_token_share(m, t)
    fc_out = (2 if m.mlp == "swiglu" else 1) * m.ffn_width  # [gate | up] for SwiGLU
    terms = {
        "norm_inputs": norms * RESIDUAL_BYTES * h,  # the residual stream, fp32
        "norm_rstd": norms * STAT_BYTES,
        # the column-parallel GEMMs' input, kept as the 1/tp sequence shard (parallel: one, shared)
        "gemm_input_shards": norms * e * h,
        "rotated_q_k": e * (a + kv) * hd,  # rope's output: SDPA's q and k, one storage
        "values": e * kv * hd,  # v, copied out of the qkv output so that it does not pin it
        "attention_output": e * a * hd,  # the projection's input
        "attention_logsumexp": STAT_BYTES * a,
        "fc_output": e * fc_out,  # the activation's input
        "activation_output": e * m.ffn_width,  # the second linear's input
        "dropout_masks": 2 if m.dropout > 0 else 0,  # attention and MLP outputs, one byte each
    }
    out = {name: per_token * tokens for name, per_token in terms.items()}
    masked = documents or (m.sliding_window is not None and m.sliding_window < s and not window_kernel)
    if layout.checkpointing == "none":
        # SDPA keeps its boolean mask as an additive copy in q's dtype per layer, whole on every tp rank
        out["attention_mask"] = e * s * s * (b if documents else 1) if masked else 0
        out["attention_scores"] = 0 if flash else 5 * a * s * s * b / t  # scores, softmax, dropout mask
    else:  # the attention core is recomputed: its statistics and masks are made again
        out["attention_logsumexp"] = 0
    return out


def kv_heads_per_token_share(m: ModelConfig, tp: int) -> float:
    """k's (and v's) heads, counted so that times hd and the 1/tp token share s*b/tp they are
    one tp rank's elements: n_kv_head when tp splits them; a rank with whole copies (fewer kv
    heads than tp ranks: layer_params) holds n_kv_head / min(tp, n_kv_head) heads of all s*b."""
    return m.kv_heads * tp / min(tp, m.kv_heads)


def layer_activation_bytes(m: ModelConfig, layout: Layout, flash: bool = True, documents: bool = False,
                           window_kernel: bool = True, act_bytes: int = ACT_BYTES) -> float:
    """Bytes one block saves for one micro-batch on one tp rank: the sum of
    `layer_activation_terms` (the same arguments); in a mixture of experts, the mean over its
    layers, an MoE layer's MLP terms being moe_plan.moe_mlp_terms."""
    terms = layer_activation_terms(m, layout, flash, documents, window_kernel, act_bytes)
    total = sum(terms.values())
    if m.moe is None:
        return total
    tokens = m.seq_len * layout.micro_batch / layout.tp
    moe_mlp = sum(moe_mlp_terms(m, layout, act_bytes).values()) * tokens
    return total + m.moe_layers / m.n_layer * (moe_mlp - terms["fc_output"] - terms["activation_output"])


def layer_input_bytes(m: ModelConfig, layout: Layout) -> float:
    """What full recomputation keeps of a layer: its input, the residual stream's 1/tp shard."""
    return RESIDUAL_BYTES * m.seq_len * layout.micro_batch * m.d_model / layout.tp


def in_flight_layers(m: ModelConfig, layout: Layout, stage: int, schedule: str = "1f1b") -> float:
    """Layers' worth of micro-batch activations pipeline `stage` holds at its peak: all m
    micro-batches under GPipe (every forward before any backward), min(m, p - stage) under 1F1B,
    Megatron's warm-up count of model chunks interleaved."""
    p, v = layout.pp, layout.virtual_stages
    if schedule == "gpipe" or p == 1:
        return layout.n_micro * m.n_layer / p if p > 1 else m.n_layer
    if v == 1:
        return min(layout.n_micro, p - stage) * m.n_layer / p
    chunks = min(layout.n_micro * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return chunks * m.n_layer / (p * v)


def stage_activation_bytes(m: ModelConfig, layout: Layout, stage: int, flash: bool = True,
                           schedule: str = "1f1b", act_bytes: int = ACT_BYTES) -> float:
    s, b, h, t = m.seq_len, layout.micro_batch, m.d_model, layout.tp
    per_layer = layer_activation_bytes(m, layout, flash, act_bytes=act_bytes)
    layers = in_flight_layers(m, layout, stage, schedule)
    if layout.checkpointing == "full":
        # each layer keeps its input; the one being recomputed holds all of its activations
        acts = layers * layer_input_bytes(m, layout) + layer_activation_bytes(
            m, dataclasses.replace(layout, checkpointing="none"), flash, act_bytes=act_bytes)
    else:
        acts = layers * per_layer
    if stage == layout.pp - 1:
        # final norm input and the logits: act_bytes out of the lm head, fp32 log-softmax for the loss
        acts += (RESIDUAL_BYTES * s * b * h + (act_bytes + 4) * s * b * m.vocab_size) / t
    return acts


def weights_and_grads(m: ModelConfig, layout: Layout, stage: int, blocks_per_unit: int = 1,
                      reshard: bool = True) -> tuple[float, float]:
    """Bytes of weights and of gradients one GPU of pipeline `stage` holds at its peak: all of
    both at ZeRO stage 2; at stage 3 the gathered units (the fp32 shards are the optimizer's
    masters) and the gradients in flight (see the module's doc)."""
    params = stage_params(m, layout, stage)
    if layout.zero_stage == 2:
        return params * WEIGHT_BYTES, params * GRAD_BYTES
    gathered = zero3_gathered_params(m, layout, stage, blocks_per_unit, reshard)
    largest = max(stage_units(m, layout, stage, blocks_per_unit))
    in_flight = params if layout.n_micro > 1 else min(params, gathered + largest)
    return WEIGHT_BYTES * gathered, GRAD_BYTES * (in_flight + sharded_params(m, layout, params))


def memory(m: ModelConfig, layout: Layout, flash: bool = True, schedule: str = "1f1b",
           act_bytes: int = ACT_BYTES, blocks_per_unit: int = 1, reshard: bool = True) -> Memory:
    """Memory of the fullest stage (the first or the last) for `layout`; `act_bytes`: 2 under
    bf16 autocast, 4 in fp32 (CPU ranks' default); `blocks_per_unit`, `reshard`: stage 3's
    parallel.zero3_blocks_per_unit and parallel.reshard_after_forward."""
    best = None
    for stage in sorted({0, layout.pp - 1}):
        params = stage_params(m, layout, stage)
        weights, grads = weights_and_grads(m, layout, stage, blocks_per_unit, reshard)
        candidate = Memory(
            weights=weights, grads=grads, optimizer=sharded_params(m, layout, params) * SHARDED_STATE_BYTES,
            activations=stage_activation_bytes(m, layout, stage, flash, schedule, act_bytes), stage=stage,
        )
        if best is None or candidate.total > best.total:
            best = candidate
    assert best is not None
    return best
