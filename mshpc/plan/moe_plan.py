"""What a mixture of experts adds to the plan: parameters (all of them, and those one token
meets), each GPU's local experts under expert parallelism, what an MoE layer saves for
backward, and the all-to-all of its dispatch and combine in the step time.

A token meets the router, its top_k experts and the shared ones (mfu.layer_matrix_params with
active=True; Megatron-Core counts FLOPs the same way). Under ep each GPU holds n_experts / ep
experts of every MoE layer, whole on every tp rank (mshpc does not split experts by tp), their
ZeRO state sharded over the dp / ep ranks that hold the same experts. Each of a micro-batch's
token copies crosses the ep group four times per layer (dispatch and combine, forward and
backward), (ep - 1) / ep of them to another rank (uniform routing; Megatron-Core's MoE guide).
"""

from __future__ import annotations

from mshpc.config import ModelConfig
from mshpc.diagnose.mfu import model_matrix_params
from mshpc.plan.layout import Layout

STAT_BYTES = 4  # fp32: the router's logits and probabilities
ALL_TO_ALLS_PER_LAYER = 4  # dispatch and combine, forward and backward


def model_params(m: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model, or (`active`) those one token's forward uses: the
    embedding, every layer (its matrices, norms and q/k norms), the final norm, an untied head."""
    norms = m.d_model * (2 if m.norm == "layernorm" else 1)
    per_layer_norms = norms * (1 if m.parallel_block else 2) + (2 * m.head_size if m.qk_norm else 0)
    layers = model_matrix_params(m, active) + m.n_layer * per_layer_norms
    table = m.vocab_size * m.d_model
    return table * (1 if m.tie_embeddings else 2) + layers + norms


def local_expert_params(m: ModelConfig, ep: int) -> int:
    """One MoE layer's routed-expert weights on one GPU: n_experts / ep experts of 3 d x expert_ffn."""
    if m.moe is None:
        return 0
    return m.moe.n_experts // ep * 3 * m.d_model * m.expert_ffn


def moe_mlp_terms(m: ModelConfig, layout: Layout, act_bytes: int) -> dict[str, float]:
    """What an MoE layer saves for backward in place of the MLP's fc_output and activation_output,
    per token of a tp rank's share: the router's fp32 input, logits and probabilities; each of
    the top_k copies' permuted input, [gate | up], SwiGLU output and expert output (the
    unpermute's, for the weights' gradient); the shared experts' MLP. Under ep a rank computes as
    many copies as it routes (balanced routing)."""
    assert m.moe is not None
    k, d, e = m.moe.top_k, m.d_model, act_bytes
    return {
        "router": STAT_BYTES * (d + 2 * m.moe.n_experts),
        "expert_inputs": k * e * d,
        "expert_fc_output": k * e * 2 * m.expert_ffn,
        "expert_activation_output": k * e * m.expert_ffn,
        "expert_outputs": k * e * d,
        "shared_experts": e * 3 * m.shared_ffn,
    }


def all_to_all_bytes(m: ModelConfig, layout: Layout, act_bytes: int) -> float:
    """Bytes one all-to-all of one MoE layer sends to other ep ranks per micro-batch, per GPU:
    its b * s / tp tokens' top_k copies of d elements, (ep - 1) / ep of them off the GPU."""
    if m.moe is None or layout.ep == 1:
        return 0.0
    tokens = layout.micro_batch * m.seq_len / layout.tp
    return tokens * m.moe.top_k * m.d_model * act_bytes * (layout.ep - 1) / layout.ep


def ep_link_gbps(layout: Layout, intra_gbps: float, inter_gbps: float, gpus_per_node: int) -> float:
    # ep peers are consecutive dp ranks, tp apart: inside one node while tp * ep fits in it
    return intra_gbps if layout.tp * layout.ep <= gpus_per_node else inter_gbps


def ep_exposed_s(m: ModelConfig, layout: Layout, gbps: float, act_bytes: int, overlap_chunks: int,
                 expert_s: float) -> float:
    """One micro-batch's all-to-alls on one stage (ALL_TO_ALLS_PER_LAYER per MoE layer; an
    all-to-all's time is its bytes at the link's rate, nccl-tests' busbw factor 1), less what the
    chunked overlap hides: all but one chunk's worth, and no more than the experts' compute."""
    if layout.ep == 1 or m.moe is None:
        return 0.0
    layers = m.moe_layers / layout.pp
    comm = layers * ALL_TO_ALLS_PER_LAYER * all_to_all_bytes(m, layout, act_bytes) / (gbps * 1e9)
    if overlap_chunks <= 1:
        return comm
    return max(comm / overlap_chunks, comm - expert_s)


def expert_fraction(m: ModelConfig) -> float:
    """The share of a token's training FLOPs in its routed experts (what the all-to-all can hide behind)."""
    if m.moe is None:
        return 0.0
    routed = m.moe.top_k * 3 * m.d_model * m.expert_ffn * m.moe_layers
    return routed / model_matrix_params(m, active=True)
