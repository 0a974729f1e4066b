"""Mixtures of experts to and from transformers in one process: an mshpc model of each exportable
kind exported (`write_hf`) computes the same logits in transformers' Mixtral, Qwen2-MoE and
Qwen3-MoE, and imports back to the same config and weights; what has no equivalent is one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.hf_models import MAX_RELATIVE_DIFF, TINY, hf_logits, mshpc_logits, relative_diff, tokens

from mshpc.config import ModelConfig, MoEConfig
from mshpc.data.tokenizer import ByteTokenizer
from mshpc.errors import InteropError
from mshpc.interop.hf_arch import hf_architecture, hf_config, model_config
from mshpc.interop.hf_export import write_hf
from mshpc.interop.hf_import import hf_model_config, load_hf_weights
from mshpc.model.gpt import GPT

BASE = ModelConfig(**{**TINY, "n_layer": 3}, norm="rmsnorm", mlp="swiglu", n_kv_head=2, ffn_dim=40,
                   tie_embeddings=False)
EXPERTS = MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=24)
CASES = {
    "MixtralForCausalLM": dataclasses.replace(BASE, moe=EXPERTS),
    # shared experts with their gate, a dense first layer, top-k weights as they come
    "Qwen2MoeForCausalLM": dataclasses.replace(BASE, moe=dataclasses.replace(
        EXPERTS, n_shared_experts=2, shared_expert_gate=True, norm_topk_prob=False, first_dense_layers=1)),
    # q/k norms, heads wider than d_model / n_head, every other layer routed
    "Qwen3MoeForCausalLM": dataclasses.replace(BASE, head_dim=16, qk_norm=True, moe=dataclasses.replace(EXPERTS, every=2)),
}


def drawn(m: ModelConfig) -> GPT:
    torch.manual_seed(0)
    model = GPT(m)
    with torch.no_grad():  # norms away from 1, so that a swapped or missing one shows
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("arch", list(CASES))
def test_export_computes_the_same_logits_and_imports_back(arch, tmp_path):
    m = CASES[arch]
    assert hf_architecture(m) == arch
    model = drawn(m)
    write_hf(tmp_path / "hf", m, {n: p.detach().clone() for n, p in model.named_parameters()}, ByteTokenizer())
    idx = tokens(m)
    assert relative_diff(hf_logits(tmp_path / "hf", idx), mshpc_logits(model, idx)) <= MAX_RELATIVE_DIFF
    back = hf_model_config(tmp_path / "hf")
    same = dataclasses.replace(m, fused_kernels=back.fused_kernels, init_std=back.init_std)
    if arch == "MixtralForCausalLM":  # Mixtral has no dense MLP: its one width is the experts'
        same = dataclasses.replace(same, ffn_dim=24)
    assert back == same
    mine = dataclasses.replace(back, fused_kernels=m.fused_kernels)  # the original's kernels: the same bits
    again = GPT(mine)
    load_hf_weights(again, mine, tmp_path / "hf")
    assert torch.equal(mshpc_logits(again, idx), mshpc_logits(model, idx))


@pytest.mark.parametrize("change, words", [
    ({"moe": dataclasses.replace(EXPERTS, router="sigmoid_bias")}, "no transformers mixture of experts routes so"),
    ({"moe": dataclasses.replace(EXPERTS, n_shared_experts=1)}, "Qwen2MoeForCausalLM gates its shared expert"),
    ({"moe": dataclasses.replace(EXPERTS, first_dense_layers=1)}, "has no transformers equivalent"),
    ({"moe": dataclasses.replace(EXPERTS, n_shared_experts=1, shared_expert_gate=True), "qk_norm": True},
     "Qwen3MoeForCausalLM has none"),
    ({"qk_norm": True}, "neither with a q/k norm"),
])
def test_what_transformers_cannot_compute_is_one_line(change, words):
    with pytest.raises(InteropError, match=words) as err:
        hf_architecture(dataclasses.replace(BASE, **change))
    assert "\n" not in str(err.value) and ("supported" in str(err.value) or "choose" in str(err.value))


def test_qwen_routed_layers_map_to_first_dense_and_every():
    cfg = hf_config(CASES["Qwen2MoeForCausalLM"], "float32")
    assert cfg["mlp_only_layers"] == [0] and cfg["decoder_sparse_step"] == 1
    step2 = {**cfg, "decoder_sparse_step": 2, "mlp_only_layers": []}  # Qwen routes layers 1, 3, 5
    with pytest.raises(InteropError, match=r"routed layers \[1\] are not"):
        model_config(step2, "q")  # 3 layers: only layer 1 routed, which no (first, every) says
    six = model_config({**step2, "num_hidden_layers": 6, "decoder_sparse_step": 1, "mlp_only_layers": [0, 1, 3, 5]}, "q")
    assert [i for i in range(6) if six.is_moe_layer(i)] == [2, 4]
