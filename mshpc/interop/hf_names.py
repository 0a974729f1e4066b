"""Whole weights between mshpc's names and layouts and Hugging Face's, both ways.

mshpc keeps one fused `attn.qkv.weight` with rows [q heads; k heads; v heads] and, for SwiGLU, one
`mlp.fc.weight` with rows [gate; up]. Llama (and Mistral, and Qwen2, whose q/k/v_proj have
biases: mshpc's `attn.qkv.bias`, [q; k; v] alike) splits them into q/k/v_proj and gate/up_proj.
GPT-NeoX fuses qkv too but interleaves it per head, rows [q_h; k_h; v_h] for each head h (its
attention views the output as (heads, 3 * head_dim)), and it has biases in attention and MLP:
zeros where mshpc has none. A weight tied to the embedding is written once, as transformers'
save_pretrained does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mshpc.config import ModelConfig
from mshpc.errors import InteropError
from mshpc.interop.hf_arch import LLAMA_FAMILY
from mshpc.interop.hf_moe import MOE_ARCHITECTURES, moe_layer_from_hf, moe_layer_to_hf

Weights = dict[str, torch.Tensor]
NEOX_HEADS = ("embed_out.weight", "lm_head.weight")  # transformers 4.x's name, and 5.x's


def _qkv_sizes(m: ModelConfig) -> list[int]:
    hd = m.head_size
    return [m.n_head * hd, m.kv_heads * hd, m.kv_heads * hd]


def neox_qkv(qkv: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """mshpc's [q; k; v] rows (3d, d) in GPT-NeoX's per-head interleaving."""
    return qkv.unflatten(0, (3, m.n_head, -1)).transpose(0, 1).flatten(0, 2).contiguous()


def mshpc_qkv(qkv: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """`neox_qkv`'s inverse."""
    return qkv.unflatten(0, (m.n_head, 3, -1)).transpose(0, 1).flatten(0, 2).contiguous()


def _outer(w: Weights, m: ModelConfig, embed: str, norm: str, head: str) -> Weights:
    """Embedding, final norm and (untied) head under the HF names given."""
    out = {embed: w["tok_embeddings.weight"]}
    out.update({f"{norm}.{k}": v for k, v in (("weight", w["norm.weight"]), ("bias", w.get("norm.bias")))
                if v is not None})
    if not m.tie_embeddings:
        out[head] = w["lm_head.weight"]
    return out


def _neox_layer(w: Weights, m: ModelConfig, i: int) -> Weights:
    p, h = f"layers.{i}.", f"gpt_neox.layers.{i}."
    post = "ln_1" if m.parallel_block else "ln_2"  # a parallel block's MLP reads ln_1's output too
    d, ffn = m.d_model, m.ffn_width
    zeros = w[p + "attn.proj.weight"].new_zeros
    return {
        h + "input_layernorm.weight": w[p + "ln_1.weight"], h + "input_layernorm.bias": w[p + "ln_1.bias"],
        h + "post_attention_layernorm.weight": w[p + post + ".weight"].clone(),
        h + "post_attention_layernorm.bias": w[p + post + ".bias"].clone(),
        h + "attention.query_key_value.weight": neox_qkv(w[p + "attn.qkv.weight"], m),
        h + "attention.query_key_value.bias": neox_qkv(w[p + "attn.qkv.bias"], m) if m.qkv_bias else zeros(3 * d),
        h + "attention.dense.weight": w[p + "attn.proj.weight"], h + "attention.dense.bias": zeros(d),
        h + "mlp.dense_h_to_4h.weight": w[p + "mlp.fc.weight"],
        h + "mlp.dense_h_to_4h.bias": w.get(p + "mlp.fc_bias", zeros(ffn)),
        h + "mlp.dense_4h_to_h.weight": w[p + "mlp.proj.weight"],
        h + "mlp.dense_4h_to_h.bias": w.get(p + "mlp.proj.bias", zeros(d)),
    }


def _llama_attention(w: Weights, m: ModelConfig, i: int) -> Weights:
    """Layer i's norms and attention under Llama's names (Qwen3's q and k norms too)."""
    p, h = f"layers.{i}.", f"model.layers.{i}."
    q, k, v = (t.clone() for t in w[p + "attn.qkv.weight"].split(_qkv_sizes(m)))
    out = {
        h + "input_layernorm.weight": w[p + "ln_1.weight"], h + "post_attention_layernorm.weight": w[p + "ln_2.weight"],
        h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k, h + "self_attn.v_proj.weight": v,
        h + "self_attn.o_proj.weight": w[p + "attn.proj.weight"],
    }
    if m.qk_norm:
        out.update({h + "self_attn.q_norm.weight": w[p + "attn.q_norm"], h + "self_attn.k_norm.weight": w[p + "attn.k_norm"]})
    if m.qkv_bias:
        for x, b in zip("qkv", w[p + "attn.qkv.bias"].split(_qkv_sizes(m)), strict=True):
            out[h + f"self_attn.{x}_proj.bias"] = b.clone()
    return out


def _llama_layer(w: Weights, m: ModelConfig, i: int) -> Weights:
    p, h = f"layers.{i}.", f"model.layers.{i}."
    gate, up = (t.clone() for t in w[p + "mlp.fc.weight"].chunk(2))
    return {
        **_llama_attention(w, m, i),
        h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up, h + "mlp.down_proj.weight": w[p + "mlp.proj.weight"],
    }


def to_hf(arch: str, m: ModelConfig, w: Weights) -> Weights:
    """mshpc's whole weights `w` (GPT's parameter names) under `arch`'s names and layouts."""
    if arch in MOE_ARCHITECTURES:
        out = _outer(w, m, "model.embed_tokens.weight", "model.norm", "lm_head.weight")
        for i in range(m.n_layer):
            out.update({**_llama_attention(w, m, i), **moe_layer_to_hf(arch, w, m, i)})
        return out
    if arch in LLAMA_FAMILY:
        out = _outer(w, m, "model.embed_tokens.weight", "model.norm", "lm_head.weight")
        layer = _llama_layer
    else:
        out = _outer(w, m, "gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm", NEOX_HEADS[0])
        layer = _neox_layer
    for i in range(m.n_layer):
        out.update(layer(w, m, i))
    return out


def hf_shapes(arch: str, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor `to_hf` gives for model `m` (and of NeoX's head under its other
    name), computed on the meta device: nothing is allocated, whatever the sizes."""
    from mshpc.model.gpt import GPT

    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in to_hf(arch, m, dict(GPT(m).named_parameters())).items()}
    if NEOX_HEADS[0] in shapes:
        shapes[NEOX_HEADS[1]] = shapes[NEOX_HEADS[0]]
    return shapes


# buffers older transformers saved with GPT-NeoX weights: derived from the config, not weights
NEOX_BUFFERS = (".attention.rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")


class HfTensors:
    """A Hugging Face checkpoint's tensors by name (`get` reads one on demand), taken once each,
    so that what no mshpc weight took can be named; errors name `where`. `shapes` are the files'
    own (from their headers); once `expect` is given the config's, a tensor is read only if its
    shape is the one the config implies."""

    def __init__(self, names: set[str], get: Callable[[str], torch.Tensor], where: str,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        self.names, self.get, self.where = names, get, where
        self.shapes = shapes or {}
        self.expected: dict[str, tuple[int, ...]] = {}
        self.taken: set[str] = set()

    def expect(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.expected = shapes

    def take(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise InteropError(f"{self.where}: has no tensor {name!r}, which its config.json implies")
        have, want = self.shapes.get(name), self.expected.get(name)
        if have is not None and want is not None and have != want:
            raise InteropError(f"{self.where}: {name} is {list(have)} in its safetensors, but its config.json "
                               f"implies {list(want)}")
        self.taken.add(name)
        return self.get(name)

    def take_first(self, *names: str) -> torch.Tensor:
        return self.take(next((n for n in names if n in self.names), names[0]))

    def zero(self, name: str, why: str) -> None:
        """Take `name`, which must be all zeros: mshpc's model has no place for it."""
        if name in self.names and self.take(name).count_nonzero():
            raise InteropError(f"{self.where}: {name} is not zero, and {why}")

    def check_all_taken(self) -> None:
        left = sorted(n for n in self.names - self.taken if not n.endswith(NEOX_BUFFERS))
        if left:
            raise InteropError(f"{self.where}: {len(left)} tensor(s) have no place in the mshpc model, "
                               f"e.g. {left[0]!r}")


def _llama_attention_weights(src: HfTensors, m: ModelConfig, i: int) -> Weights:
    h, p = f"model.layers.{i}.", f"layers.{i}."
    # Qwen2's q/k/v biases are the model's (qkv_bias); elsewhere (Qwen2-MoE) they must be zero
    biases = {p + "attn.qkv.bias": torch.cat([src.take(h + f"self_attn.{x}_proj.bias") for x in "qkv"])} if m.qkv_bias else {}
    for x in "o" if m.qkv_bias else "qkvo":
        src.zero(h + f"self_attn.{x}_proj.bias", "mshpc's attention has no biases there (model.qkv_bias=false)")
    out = {**biases,
        p + "ln_1.weight": src.take(h + "input_layernorm.weight"),
        p + "ln_2.weight": src.take(h + "post_attention_layernorm.weight"),
        p + "attn.qkv.weight": torch.cat([src.take(h + f"self_attn.{x}_proj.weight") for x in "qkv"]),
        p + "attn.proj.weight": src.take(h + "self_attn.o_proj.weight"),
    }
    if m.qk_norm:
        out.update({p + "attn.q_norm": src.take(h + "self_attn.q_norm.weight"),
                    p + "attn.k_norm": src.take(h + "self_attn.k_norm.weight")})
    return out


def _llama_weights(src: HfTensors, m: ModelConfig, i: int) -> Weights:
    h, p = f"model.layers.{i}.", f"layers.{i}."
    return {
        **_llama_attention_weights(src, m, i),
        p + "mlp.fc.weight": torch.cat([src.take(h + f"mlp.{x}_proj.weight") for x in ("gate", "up")]),
        p + "mlp.proj.weight": src.take(h + "mlp.down_proj.weight"),
    }


def _neox_weights(src: HfTensors, m: ModelConfig, i: int) -> Weights:
    h, p = f"gpt_neox.layers.{i}.", f"layers.{i}."
    out = {p + "ln_1." + k: src.take(h + "input_layernorm." + k) for k in ("weight", "bias")}
    post = {k: src.take(h + "post_attention_layernorm." + k) for k in ("weight", "bias")}
    if not m.parallel_block:
        out.update({p + "ln_2." + k: v for k, v in post.items()})
    elif any(not torch.equal(v, out[p + "ln_1." + k]) for k, v in post.items()):
        raise InteropError(f"{src.where}: layer {i}'s two layer norms differ; mshpc's parallel block has "
                           "one (use_parallel_residual with shared norms only)")
    if m.qkv_bias:
        out[p + "attn.qkv.bias"] = mshpc_qkv(src.take(h + "attention.query_key_value.bias"), m)
    else:
        src.zero(h + "attention.query_key_value.bias", "the config has model.qkv_bias=false")
    src.zero(h + "attention.dense.bias", "mshpc's attention output projection has no bias")
    out[p + "attn.qkv.weight"] = mshpc_qkv(src.take(h + "attention.query_key_value.weight"), m)
    out[p + "attn.proj.weight"] = src.take(h + "attention.dense.weight")
    out[p + "mlp.fc.weight"] = src.take(h + "mlp.dense_h_to_4h.weight")
    out[p + "mlp.proj.weight"] = src.take(h + "mlp.dense_4h_to_h.weight")
    for hf_name, name in (("mlp.dense_h_to_4h.bias", "mlp.fc_bias"), ("mlp.dense_4h_to_h.bias", "mlp.proj.bias")):
        if m.mlp_bias:
            out[p + name] = src.take(h + hf_name)
        else:
            src.zero(h + hf_name, "the config has model.mlp_bias=false")
    return out


def from_hf(arch: str, m: ModelConfig, src: HfTensors) -> Weights:
    """`to_hf`'s inverse: the whole mshpc weights of model `m` from a checkpoint of `arch`;
    an InteropError for a missing tensor, one with no place in mshpc, or a nonzero bias mshpc lacks."""
    src.expect(hf_shapes(arch, m))  # before any tensor is read: none of another size is
    llama = arch in LLAMA_FAMILY or arch in MOE_ARCHITECTURES
    embed, norm = ("model.embed_tokens", "model.norm") if llama else ("gpt_neox.embed_in", "gpt_neox.final_layer_norm")
    out = {"tok_embeddings.weight": src.take(embed + ".weight"), "norm.weight": src.take(norm + ".weight")}
    if not llama:
        out["norm.bias"] = src.take(norm + ".bias")
    heads = ("lm_head.weight",) if llama else NEOX_HEADS
    if not m.tie_embeddings:
        out["lm_head.weight"] = src.take_first(*heads)
    else:
        src.taken.update(heads)  # a tied checkpoint may still carry its copy of the embedding
    for i in range(m.n_layer):
        if arch in MOE_ARCHITECTURES:
            out.update({**_llama_attention_weights(src, m, i), **moe_layer_from_hf(arch, src, m, i)})
        else:
            out.update((_llama_weights if llama else _neox_weights)(src, m, i))
    src.check_all_taken()
    return out
