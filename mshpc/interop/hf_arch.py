"""Which Hugging Face architecture an mshpc model is, and the `config.json` of each way.

Two architectures hold mshpc's models exactly: `LlamaForCausalLM` (RMSNorm, SwiGLU, serial
blocks, grouped-query attention) and `GPTNeoXForCausalLM` (LayerNorm, GeLU, serial or parallel
blocks). Both rotate q and k in the rotate-half pairing (x[i], x[i + hd/2]) that mshpc uses
(kernels/reference.py `rope`), so no q/k rows are permuted: Llama's conversion script permutes
only because Meta's original checkpoints pair (x[2i], x[2i+1]).
"""

from __future__ import annotations

from typing import Any

from mshpc.config import ModelConfig
from mshpc.errors import InteropError
from mshpc.interop.hf_moe import MOE_ARCHITECTURES, moe_architecture, moe_hf_config, moe_model_fields

LLAMA = "LlamaForCausalLM"
NEOX = "GPTNeoXForCausalLM"
ARCHITECTURES = (LLAMA, NEOX, *MOE_ARCHITECTURES)

# (model.norm, model.mlp, model.parallel_block) -> the architecture that computes exactly that
SUPPORTED = {
    ("rmsnorm", "swiglu", False): LLAMA,
    ("layernorm", "gelu", False): NEOX,
    ("layernorm", "gelu", True): NEOX,
}
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
    arch = SUPPORTED[key]
    if m.sliding_window is not None:
        raise InteropError(f"model.sliding_window={m.sliding_window}: {arch} has no sliding window "
                           "(export a model trained with sliding_window: null)")
    if arch == NEOX and m.kv_heads != m.n_head:
        raise InteropError(f"model.n_kv_head={m.n_kv_head}: {NEOX} has no grouped-query attention "
                           f"(choose n_kv_head null, or rmsnorm + swiglu -> {LLAMA})")
    if arch == LLAMA and m.mlp_bias:
        raise InteropError(f"model.mlp_bias=true: mshpc exports {LLAMA} without MLP biases "
                           "(choose mlp_bias false)")
    return arch


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    """config.json for model `m` (weights of `dtype`, e.g. "float32"). Rope settings go both as
    transformers 5 reads them (`rope_parameters`) and as 4.x did (`rope_theta`, `rotary_pct`,
    `rotary_emb_base`), so either loads the same model."""
    arch = hf_architecture(m)
    head_dim = m.head_size
    common = {
        "architectures": [arch], "vocab_size": m.vocab_size, "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layer, "num_attention_heads": m.n_head,
        "intermediate_size": m.ffn_width, "max_position_embeddings": m.seq_len,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    if arch in MOE_ARCHITECTURES:
        return moe_hf_config(arch, m, common)
    if arch == LLAMA:
        return {**common, "model_type": "llama", "num_key_value_heads": m.kv_heads, "head_dim": head_dim,
                "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "attention_bias": False, "mlp_bias": False,
                "rope_theta": m.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}}
    # mshpc rotates every head dim: rotary_pct 1.0 (GPT-NeoX's own default is 0.25)
    return {**common, "model_type": "gpt_neox", "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": m.norm_eps, "use_parallel_residual": m.parallel_block,
            "attention_bias": True, "rotary_pct": 1.0, "rotary_emb_base": m.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                                "partial_rotary_factor": 1.0}}


def _rope(hf: dict[str, Any], where: str) -> tuple[float, float]:
    """(rope theta, fraction of head dims rotated) from either generation of config.json; an
    InteropError for a rope scaling mshpc does not implement."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise InteropError(f"{where}: rope scaling {kind!r} is not implemented in mshpc "
                           "(only plain RoPE, rope_type 'default')")
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    fraction = params.get("partial_rotary_factor", hf.get("rotary_pct", hf.get("partial_rotary_factor", 1.0)))
    return float(theta), float(fraction)


def _require(hf: dict[str, Any], where: str, key: str, ok: Any, want: str, default: Any = None) -> None:
    if hf.get(key, default) not in ok:
        raise InteropError(f"{where}: {key}={hf.get(key)!r} is not implemented in mshpc (it needs {want})")


def _number(hf: dict[str, Any], where: str, key: str, default: float | None = None) -> float:
    """config.json's number `key` (`default` when absent), or a one-line InteropError."""
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InteropError(f"{where}: config.json has no number {key!r} (got {value!r})")
    return value


def model_config(hf: dict[str, Any], where: str, mlp_bias: bool = False) -> ModelConfig:
    """The mshpc model of a Llama or GPT-NeoX config.json (`where` names it in errors);
    `mlp_bias`: whether the checkpoint's MLP biases are to be kept (GPT-NeoX only)."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise InteropError(f"{where}: architecture {arch!r} is not supported (choose {' or '.join(ARCHITECTURES)})")
    d, n_head = int(_number(hf, where, "hidden_size")), int(_number(hf, where, "num_attention_heads"))
    theta, fraction = _rope(hf, where)
    if fraction != 1.0:
        raise InteropError(f"{where}: rotary on {fraction:g} of each head is not implemented in mshpc "
                           "(it rotates every head dim: rotary_pct 1.0)")
    head_dim = hf.get("head_dim") or d // n_head
    if arch == NEOX and head_dim != d // n_head:
        raise InteropError(f"{where}: head_dim={hf['head_dim']} is not hidden_size/num_attention_heads="
                           f"{d // n_head}, which mshpc needs for {NEOX}")
    fields: dict[str, Any] = dict(
        vocab_size=int(_number(hf, where, "vocab_size")), seq_len=int(_number(hf, where, "max_position_embeddings")),
        n_layer=int(_number(hf, where, "num_hidden_layers")), n_head=n_head, d_model=d,
        ffn_dim=int(_number(hf, where, "intermediate_size")),
        head_dim=None if head_dim * n_head == d else int(head_dim),
        rope_theta=theta, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(_number(hf, where, "initializer_range", 0.02)))
    if arch in MOE_ARCHITECTURES:
        fields.update(moe_model_fields(arch, hf, where, fields["n_layer"]))
    if arch == LLAMA or arch in MOE_ARCHITECTURES:
        _require(hf, where, "hidden_act", ("silu",), "'silu'", default="silu")
        _require(hf, where, "attention_bias", (False, None), "attention_bias false")
        _require(hf, where, "mlp_bias", (False, None), "mlp_bias false")
        kv = int(hf.get("num_key_value_heads") or n_head)
        fields.update(norm="rmsnorm", mlp="swiglu", parallel_block=False, norm_eps=float(_number(hf, where, "rms_norm_eps", 1e-6)),
                      n_kv_head=None if kv == n_head else kv)
    else:
        _require(hf, where, "hidden_act", TANH_GELUS, f"GeLU's tanh form: {' or '.join(TANH_GELUS)}")
        fields.update(norm="layernorm", mlp="gelu", norm_eps=float(_number(hf, where, "layer_norm_eps", 1e-5)), mlp_bias=mlp_bias,
                      parallel_block=bool(hf.get("use_parallel_residual", True)))
    return ModelConfig(**fields)
