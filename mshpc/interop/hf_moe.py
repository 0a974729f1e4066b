"""Mixtures of experts as Hugging Face architectures, both ways: MixtralForCausalLM (every layer
routed, top-k renormalised, no shared experts), Qwen2MoeForCausalLM (a gated shared expert
beside the routed ones) and Qwen3MoeForCausalLM (per-head RMSNorm of q and k, no shared expert),
all with Llama's attention, norms and softmax top-k router. Weights in the per-expert layout the
Hub's checkpoints use (`experts.{e}.w1` / `gate_proj`, ...), which transformers 4 and 5 both load
and transformers 5's save_pretrained writes; the fused `experts.gate_up_proj` is read too.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mshpc.config import ModelConfig, MoEConfig
from mshpc.errors import InteropError, shown

MIXTRAL = "MixtralForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
Weights = dict[str, torch.Tensor]


def moe_architecture(m: ModelConfig) -> str:
    """The architecture that computes the mixture of experts `m` exactly, or an InteropError
    naming what stands in the way and the supported ones."""
    moe = m.moe
    assert moe is not None
    supported = f"(supported: {', '.join(MOE_ARCHITECTURES)}: softmax top-k routers, RMSNorm, SwiGLU experts)"
    if moe.router != "softmax_topk":
        raise InteropError(f"model.moe.router={moe.router}: no transformers mixture of experts routes so {supported}")
    if m.norm != "rmsnorm" or m.mlp != "swiglu" or m.parallel_block or m.mlp_bias or m.sliding_window is not None:
        raise InteropError("an MoE model exports only with model.norm=rmsnorm, mlp=swiglu, serial blocks, no MLP "
                           f"biases and no sliding window {supported}")
    if m.qk_norm:
        if moe.n_shared_experts:
            raise InteropError(f"model.qk_norm with shared experts: {QWEN3_MOE} has none, {QWEN2_MOE} no qk norm {supported}")
        return QWEN3_MOE
    if moe.n_shared_experts:
        if not moe.shared_expert_gate:
            raise InteropError(f"shared experts without model.moe.shared_expert_gate: {QWEN2_MOE} gates its shared "
                               f"expert {supported}")
        return QWEN2_MOE
    if moe.first_dense_layers == 0 and moe.every == 1 and (moe.norm_topk_prob or moe.top_k == 1):
        return MIXTRAL
    raise InteropError("an MoE model with dense layers or unnormalised top-k weights and no qk norm has no "
                       f"transformers equivalent: {MIXTRAL} routes every layer and renormalises, {QWEN3_MOE} "
                       f"has model.qk_norm {supported}")


def moe_hf_config(arch: str, m: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of `arch` for model `m` (common: the Llama-like keys the dense export writes)."""
    moe = m.moe
    assert moe is not None
    out = {**common, "num_key_value_heads": m.kv_heads, "head_dim": m.head_size, "hidden_act": "silu",
           "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None,
           "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
           "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef,
           "output_router_logits": False, "attention_dropout": 0.0, "sliding_window": None}
    if arch == MIXTRAL:
        return {**out, "model_type": "mixtral", "num_local_experts": moe.n_experts,
                "intermediate_size": m.expert_ffn, "router_jitter_noise": 0.0}
    dense = [i for i in range(m.n_layer) if not m.is_moe_layer(i)]
    out.update(model_type="qwen2_moe" if arch == QWEN2_MOE else "qwen3_moe", num_experts=moe.n_experts,
               moe_intermediate_size=m.expert_ffn, intermediate_size=m.ffn_width, decoder_sparse_step=1,
               mlp_only_layers=dense, norm_topk_prob=moe.norm_topk_prob, use_sliding_window=False)
    if arch == QWEN2_MOE:
        return {**out, "shared_expert_intermediate_size": m.shared_ffn, "qkv_bias": False}
    return {**out, "attention_bias": False}


def _int(hf: dict[str, Any], where: str, *keys: str) -> int:
    for key in keys:
        value = hf.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise InteropError(f"{where}: config.json has no integer {keys[0]!r}")


def _coef(hf: dict[str, Any], where: str, key: str, default: float) -> float:
    value = hf.get(key, default) or 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InteropError(f"{where}: config.json's {key}={shown(value)} is not a number")
    return float(value)


def moe_model_fields(arch: str, hf: dict[str, Any], where: str, n_layer: int) -> dict[str, Any]:
    """The ModelConfig fields of an MoE config.json beyond Llama's: the moe section, the expert
    width and, for Qwen3, the q/k norm; an InteropError for what mshpc does not compute."""
    experts = _int(hf, where, "num_local_experts" if arch == MIXTRAL else "num_experts", "num_experts",
                   "num_local_experts")
    top_k = _int(hf, where, "num_experts_per_tok")
    if hf.get("router_jitter_noise", 0.0) or hf.get("use_sliding_window"):
        raise InteropError(f"{where}: router jitter and sliding windows are not implemented in mshpc")
    fields: dict[str, Any] = {}
    moe: dict[str, Any] = dict(n_experts=experts, top_k=top_k,
                               aux_loss_coef=_coef(hf, where, "router_aux_loss_coef", 0.01))
    if arch == MIXTRAL:
        moe.update(expert_ffn_dim=_int(hf, where, "intermediate_size"), norm_topk_prob=True)
    else:
        moe.update(expert_ffn_dim=_int(hf, where, "moe_intermediate_size"),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
        fields["ffn_dim"] = _int(hf, where, "intermediate_size")
        moe.update(_qwen_layers(hf, where, n_layer))
    if arch == QWEN2_MOE:  # (its q/k/v biases, if any, must be zero: hf_names takes them so)
        shared = _int(hf, where, "shared_expert_intermediate_size")
        if shared % moe["expert_ffn_dim"]:
            raise InteropError(f"{where}: shared_expert_intermediate_size={shared} is not a multiple of "
                               f"moe_intermediate_size={moe['expert_ffn_dim']} (mshpc's shared experts are n of that width)")
        moe.update(n_shared_experts=shared // moe["expert_ffn_dim"], shared_expert_gate=True)
    fields.update(qk_norm=arch == QWEN3_MOE, moe=MoEConfig(**moe))
    return fields


def _qwen_layers(hf: dict[str, Any], where: str, n_layer: int) -> dict[str, int]:
    """first_dense_layers and every for Qwen's rule (layer i routed when (i + 1) % decoder_sparse_step
    == 0 and i is not in mlp_only_layers), where mshpc's rule (i >= first, i % every == 0) says the same."""
    step = _int(hf, where, "decoder_sparse_step") if "decoder_sparse_step" in hf else 1
    dense_listed = set(hf.get("mlp_only_layers") or [])
    routed = [i for i in range(n_layer) if (i + 1) % step == 0 and i not in dense_listed]
    for first in range(n_layer):
        for every in range(1, n_layer + 1):
            if routed == [i for i in range(n_layer) if i >= first and i % every == 0]:
                return {"first_dense_layers": first, "every": every}
    raise InteropError(f"{where}: its routed layers {routed} are not model.moe.first_dense_layers / every's pattern")


def moe_layer_to_hf(arch: str, w: Weights, m: ModelConfig, i: int) -> Weights:
    """Layer i's MLP part (experts, router, shared expert, or the dense MLP) under `arch`'s names."""
    p = f"layers.{i}.mlp."
    h = f"model.layers.{i}." + ("block_sparse_moe." if arch == MIXTRAL else "mlp.")
    if not m.is_moe_layer(i):
        gate, up = (t.clone() for t in w[p + "fc.weight"].chunk(2))
        return {h + "gate_proj.weight": gate, h + "up_proj.weight": up, h + "down_proj.weight": w[p + "proj.weight"]}
    names = ("w1", "w3", "w2") if arch == MIXTRAL else ("gate_proj", "up_proj", "down_proj")
    out = {h + "gate.weight": w[p + "router.weight"]}
    for e in range(w[p + "experts.fc"].shape[0]):
        gate, up = (t.clone() for t in w[p + "experts.fc"][e].chunk(2))
        for name, t in zip(names, (gate, up, w[p + "experts.proj"][e].clone()), strict=True):
            out[f"{h}experts.{e}.{name}.weight"] = t
    if arch == QWEN2_MOE:
        gate, up = (t.clone() for t in w[p + "shared.fc.weight"].chunk(2))
        out.update({h + "shared_expert.gate_proj.weight": gate, h + "shared_expert.up_proj.weight": up,
                    h + "shared_expert.down_proj.weight": w[p + "shared.proj.weight"],
                    h + "shared_expert_gate.weight": w[p + "shared_gate.weight"]})
    return out


def moe_layer_from_hf(arch: str, src: Any, m: ModelConfig, i: int) -> Weights:
    """`moe_layer_to_hf`'s inverse (`src`: hf_names.HfTensors); the experts from the per-expert
    tensors, or from transformers 5's fused gate_up_proj and down_proj."""
    p = f"layers.{i}.mlp."
    h = f"model.layers.{i}." + ("block_sparse_moe." if arch == MIXTRAL else "mlp.")
    if not m.is_moe_layer(i):
        return {p + "fc.weight": torch.cat([src.take(h + "gate_proj.weight"), src.take(h + "up_proj.weight")]),
                p + "proj.weight": src.take(h + "down_proj.weight")}
    assert m.moe is not None
    out = {p + "router.weight": src.take(h + "gate.weight")}
    if h + "experts.gate_up_proj" in src.names:
        out[p + "experts.fc"] = src.take(h + "experts.gate_up_proj")
        out[p + "experts.proj"] = src.take(h + "experts.down_proj")
    else:
        names = ("w1", "w3", "w2") if arch == MIXTRAL else ("gate_proj", "up_proj", "down_proj")
        per = [[src.take(f"{h}experts.{e}.{n}.weight") for n in names] for e in range(m.moe.n_experts)]
        out[p + "experts.fc"] = torch.stack([torch.cat(t[:2]) for t in per])
        out[p + "experts.proj"] = torch.stack([t[2] for t in per])
    if arch == QWEN2_MOE:
        s = h + "shared_expert."
        out[p + "shared.fc.weight"] = torch.cat([src.take(s + "gate_proj.weight"), src.take(s + "up_proj.weight")])
        out[p + "shared.proj.weight"] = src.take(s + "down_proj.weight")
        out[p + "shared_gate.weight"] = src.take(h + "shared_expert_gate.weight")
    return out
