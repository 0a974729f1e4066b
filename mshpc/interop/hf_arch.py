"""Which Hugging Face architecture an mshpc model is, and the `config.json` of each way.

Two families hold mshpc's dense models exactly: Llama's (RMSNorm, SwiGLU, serial blocks,
grouped-query attention): `LlamaForCausalLM`, with Llama 3.1's rope scaling; `MistralForCausalLM`,
the same with a sliding window; `Qwen2ForCausalLM`, the same with q, k and v biases; and
`GPTNeoXForCausalLM` (LayerNorm, GeLU, serial or parallel blocks). All rotate q and k in the
rotate-half pairing (x[i], x[i + hd/2]) that mshpc uses (kernels/reference.py `rope`), so no
q/k rows are permuted: Llama's conversion script permutes only because Meta's original
checkpoints pair (x[2i], x[2i+1]). Mixtures of experts: hf_moe.py.
"""

from __future__ import annotations

import math
from typing import Any

from mshpc.config import ModelConfig
from mshpc.errors import InteropError, shown
from mshpc.interop.hf_moe import MOE_ARCHITECTURES, moe_architecture, moe_hf_config, moe_model_fields

LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
NEOX = "GPTNeoXForCausalLM"
ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, NEOX, *MOE_ARCHITECTURES)
LLAMA_FAMILY = (LLAMA, MISTRAL, QWEN2)  # one layout of weights: model.layers.N.self_attn.q_proj, ...

# (model.norm, model.mlp, model.parallel_block) -> the architecture that computes exactly that
SUPPORTED = {
    ("rmsnorm", "swiglu", False): LLAMA,
    ("layernorm", "gelu", False): NEOX,
    ("layernorm", "gelu", True): NEOX,
}
COUNT_MAX = 2**40  # a size or count in config.json; the config's memory check bounds the model itself
# mshpc's GeLU is GPT-2's tanh form; these two activations in transformers compute it
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new")


def _describe(key: tuple[str, str, bool]) -> str:
    norm, mlp, parallel = key
    return f"{norm} + {mlp} + {'parallel' if parallel else 'serial'} block -> {SUPPORTED[key]}"


def hf_architecture(m: ModelConfig) -> str:
    """The architecture that computes model `m` exactly, or an InteropError naming the nearest
    supported combinations (fewest of norm, mlp, block that differ) and what else stands in the way.
    A mixture of experts: hf_moe.moe_architecture."""
    if m.moe is not None:
        return moe_architecture(m)
    if m.qk_norm:
        raise InteropError(f"model.qk_norm=true: mshpc exports {LLAMA} and {NEOX} dense models, neither with a "
                           "q/k norm (choose qk_norm false)")
    key = (m.norm, m.mlp, m.parallel_block)
    if key not in SUPPORTED:
        def distance(k: tuple[str, str, bool]) -> int:
            return sum(a != b for a, b in zip(k, key, strict=True))
        best = min(distance(k) for k in SUPPORTED)
        nearest = "; ".join(_describe(k) for k in SUPPORTED if distance(k) == best)
        raise InteropError(f"model.norm={m.norm}, model.mlp={m.mlp}, model.parallel_block="
                           f"{str(m.parallel_block).lower()} has no transformers equivalent (nearest "
                           f"supported: {nearest})")
    if SUPPORTED[key] == NEOX:
        if m.sliding_window is not None:
            raise InteropError(f"model.sliding_window={m.sliding_window}: {NEOX} has no sliding window "
                               f"(export a model trained with sliding_window: null, or rmsnorm + swiglu -> {MISTRAL})")
        if m.kv_heads != m.n_head:
            raise InteropError(f"model.n_kv_head={m.n_kv_head}: {NEOX} has no grouped-query attention "
                               f"(choose n_kv_head null, or rmsnorm + swiglu -> {LLAMA})")
        return NEOX
    if m.mlp_bias:
        raise InteropError(f"model.mlp_bias=true: mshpc exports {LLAMA} without MLP biases "
                           "(choose mlp_bias false)")
    if m.qkv_bias:
        return QWEN2  # (with a sliding window on every layer, if the model has one)
    return MISTRAL if m.sliding_window is not None else LLAMA


def _rope_json(m: ModelConfig) -> dict[str, Any]:
    """The rope keys of config.json, as transformers 5 reads them (`rope_parameters`) and as 4.x
    did (`rope_theta`, `rope_scaling`)."""
    scaling = None
    if m.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
                   "high_freq_factor": m.rope_high_freq_factor,
                   "original_max_position_embeddings": m.rope_original_seq_len}
    params = {**(scaling or {"rope_type": "default"}), "rope_theta": m.rope_theta}
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def _llama_family_config(arch: str, m: ModelConfig) -> dict[str, Any]:
    """The keys Llama, Mistral and Qwen2 share, and each one's own."""
    common = {"num_key_value_heads": m.kv_heads, "head_dim": m.head_size, "hidden_act": "silu",
              "rms_norm_eps": m.norm_eps, **_rope_json(m)}
    if arch == MISTRAL:
        return {**common, "model_type": "mistral", "sliding_window": m.sliding_window}
    if arch == QWEN2:  # its q, k, v biases need no key; a window covers every layer (max_window_layers 0)
        window = m.sliding_window is not None
        return {**common, "model_type": "qwen2", "use_sliding_window": window, "sliding_window": m.sliding_window,
                "max_window_layers": 0 if window else m.n_layer,
                "layer_types": ["sliding_attention" if window else "full_attention"] * m.n_layer}
    return {**common, "model_type": "llama", "attention_bias": False, "mlp_bias": False}


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    """config.json for model `m` (weights of `dtype`, e.g. "float32"). Rope settings go both as
    transformers 5 reads them (`rope_parameters`) and as 4.x did (`rope_theta`, `rope_scaling`,
    `rotary_pct`, `rotary_emb_base`), so either loads the same model."""
    arch = hf_architecture(m)
    common = {
        "architectures": [arch], "vocab_size": m.vocab_size, "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layer, "num_attention_heads": m.n_head,
        "intermediate_size": m.ffn_width, "max_position_embeddings": m.seq_len,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    if arch in MOE_ARCHITECTURES:
        return {**moe_hf_config(arch, m, common), **_rope_json(m)}
    if arch in LLAMA_FAMILY:
        return {**common, **_llama_family_config(arch, m)}
    # mshpc rotates every head dim: rotary_pct 1.0 (GPT-NeoX's own default is 0.25)
    rope = _rope_json(m)
    return {**common, "model_type": "gpt_neox", "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": m.norm_eps, "use_parallel_residual": m.parallel_block,
            "attention_bias": True, "rotary_pct": 1.0, "rotary_emb_base": m.rope_theta, **rope,
            "rope_parameters": {**rope["rope_parameters"], "partial_rotary_factor": 1.0}}


def _object(hf: dict[str, Any], where: str, key: str) -> dict[str, Any]:
    value = hf.get(key) or {}
    if not isinstance(value, dict):
        raise InteropError(f"{where}: config.json's {key}={shown(value)} is not an object")
    return value


def _rope(hf: dict[str, Any], where: str) -> tuple[float, float, dict[str, Any]]:
    """(rope theta, fraction of head dims rotated, the model fields of its scaling) from either
    generation of config.json; an InteropError for a rope scaling mshpc does not implement."""
    params, scaling = _object(hf, where, "rope_parameters"), _object(hf, where, "rope_scaling")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ("default", "llama3"):
        raise InteropError(f"{where}: rope scaling {shown(kind)} is not implemented in mshpc "
                           "(choose rope_type 'default' or 'llama3')")
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    fraction = params.get("partial_rotary_factor", hf.get("rotary_pct", hf.get("partial_rotary_factor", 1.0)))
    fields: dict[str, Any] = {}
    if kind == "llama3":
        source = {**scaling, **params}
        fields = dict(rope_scaling="llama3", rope_factor=float(_number(source, where, "factor")),
                      rope_low_freq_factor=float(_number(source, where, "low_freq_factor")),
                      rope_high_freq_factor=float(_number(source, where, "high_freq_factor")),
                      rope_original_seq_len=_count(source, where, "original_max_position_embeddings"))
    return (float(_number({"rope_theta": theta}, where, "rope_theta")),
            float(_number({"rotary_pct": fraction}, where, "rotary_pct")), fields)


def _require(hf: dict[str, Any], where: str, key: str, ok: Any, want: str, default: Any = None) -> None:
    value = hf.get(key, default)
    if not isinstance(value, (str, bool, type(None))) or value not in ok:
        raise InteropError(f"{where}: {key}={shown(hf.get(key))} is not implemented in mshpc (it needs {want})")


def _number(hf: dict[str, Any], where: str, key: str, default: float | None = None) -> float:
    """config.json's finite number `key` (`default` when absent), or a one-line InteropError."""
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InteropError(f"{where}: config.json has no number {key!r} (got {shown(value)})")
    return value


def _count(hf: dict[str, Any], where: str, key: str, default: int | None = None) -> int:
    """config.json's whole number `key` >= 1 (`default` when absent or null), or a one-line InteropError."""
    value = hf.get(key) if hf.get(key) is not None else default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= COUNT_MAX:
        raise InteropError(f"{where}: config.json's {key}={shown(value)} is not a whole number from 1 to {COUNT_MAX}")
    return value


def _qwen2_window(hf: dict[str, Any], where: str, n_layer: int) -> int | None:
    """Qwen2's sliding window as mshpc's (every layer or none): windows from layer
    max_window_layers on, when use_sliding_window is set."""
    if not _flag(hf, where, "use_sliding_window", False):
        return None
    window = _count(hf, where, "sliding_window")
    first = int(_number(hf, where, "max_window_layers", 0))
    if first >= n_layer:
        return None
    if first > 0:
        raise InteropError(f"{where}: a sliding window on layers {first} to {n_layer - 1} only is not implemented "
                           "in mshpc (its window covers every layer: max_window_layers 0)")
    return window


def _llama_family_fields(arch: str, hf: dict[str, Any], where: str, n_head: int, n_layer: int) -> dict[str, Any]:
    """The model fields of a Llama, Mistral or Qwen2 config.json (or an MoE one's attention and
    norms, Llama's) beyond the common ones."""
    _require(hf, where, "hidden_act", ("silu",), "'silu'", default="silu")
    _require(hf, where, "mlp_bias", (False, None), "mlp_bias false")
    if arch != QWEN2:
        _require(hf, where, "attention_bias", (False, None), "attention_bias false")
    kv = _count(hf, where, "num_key_value_heads", n_head)
    window = None
    if arch == MISTRAL and hf.get("sliding_window") is not None:
        window = _count(hf, where, "sliding_window")
    elif arch == QWEN2:
        window = _qwen2_window(hf, where, n_layer)
    return dict(norm="rmsnorm", mlp="swiglu", parallel_block=False, n_kv_head=None if kv == n_head else kv,
                norm_eps=float(_number(hf, where, "rms_norm_eps", 1e-6)), qkv_bias=arch == QWEN2,
                sliding_window=window)


def model_config(hf: dict[str, Any], where: str, mlp_bias: bool = False, qkv_bias: bool = False) -> ModelConfig:
    """The mshpc model of a Llama, Mistral, Qwen2, GPT-NeoX or mixture-of-experts config.json
    (`where` names it in errors); `mlp_bias`, `qkv_bias`: whether a GPT-NeoX checkpoint's MLP and
    qkv biases are to be kept (Qwen2 always has qkv biases)."""
    archs = hf.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise InteropError(f"{where}: architecture {shown(arch)} is not supported (choose {' or '.join(ARCHITECTURES)})")
    d, n_head = _count(hf, where, "hidden_size"), _count(hf, where, "num_attention_heads")
    theta, fraction, rope_fields = _rope(hf, where)
    if fraction != 1.0:
        raise InteropError(f"{where}: rotary on {fraction:g} of each head is not implemented in mshpc "
                           "(it rotates every head dim: rotary_pct 1.0)")
    head_dim = _count(hf, where, "head_dim", d // n_head)
    if arch == NEOX and head_dim != d // n_head:
        raise InteropError(f"{where}: head_dim={head_dim} is not hidden_size/num_attention_heads="
                           f"{d // n_head}, which mshpc needs for {NEOX}")
    fields: dict[str, Any] = dict(
        vocab_size=_count(hf, where, "vocab_size"), seq_len=_count(hf, where, "max_position_embeddings"),
        n_layer=_count(hf, where, "num_hidden_layers"), n_head=n_head, d_model=d,
        ffn_dim=_count(hf, where, "intermediate_size"),
        head_dim=None if head_dim * n_head == d else head_dim,
        rope_theta=theta, tie_embeddings=_flag(hf, where, "tie_word_embeddings", False),
        init_std=float(_number(hf, where, "initializer_range", 0.02)), **rope_fields)
    if arch in MOE_ARCHITECTURES:
        fields.update(moe_model_fields(arch, hf, where, fields["n_layer"]))
    if arch in LLAMA_FAMILY or arch in MOE_ARCHITECTURES:
        fields.update(_llama_family_fields(arch, hf, where, n_head, fields["n_layer"]))
    else:
        _require(hf, where, "hidden_act", TANH_GELUS, f"GeLU's tanh form: {' or '.join(TANH_GELUS)}")
        fields.update(norm="layernorm", mlp="gelu", norm_eps=float(_number(hf, where, "layer_norm_eps", 1e-5)),
                      mlp_bias=mlp_bias, qkv_bias=qkv_bias,
                      parallel_block=_flag(hf, where, "use_parallel_residual", True))
    return ModelConfig(**fields)


def _flag(hf: dict[str, Any], where: str, key: str, default: bool) -> bool:
    value = hf.get(key, default)
    if not isinstance(value, bool):
        raise InteropError(f"{where}: config.json's {key}={shown(value)} is not true or false")
    return value
