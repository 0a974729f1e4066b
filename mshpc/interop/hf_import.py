"""`mshpc import HF_DIR --out CONFIG.yaml` and `train.init_from: HF_DIR`: start training from a
Llama or GPT-NeoX checkpoint in safetensors.

The config's model section comes from HF_DIR/config.json (hf_arch.py refuses what mshpc does not
compute exactly); at start-up every rank reads the weights into the whole model before any
parallelism cuts it, as it would otherwise draw them from the seed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mshpc.config import Config, ModelConfig, dump_yaml, from_dict
from mshpc.errors import ConfigError, InteropError
from mshpc.interop.hf_arch import model_config
from mshpc.interop.hf_names import HfTensors, from_hf
from mshpc.interop.safetensors_files import read_safetensors
from mshpc.model.gpt import GPT
from mshpc.regular_files import read_regular

log = logging.getLogger(__name__)

# What must agree between train.init_from's config.json and the config's model (seq_len, dropout,
# init and kernels may differ: they change no weight and no function of the weights).
SAME = ("vocab_size", "n_layer", "n_head", "d_model", "ffn_width", "kv_heads", "norm", "mlp",
        "parallel_block", "tie_embeddings", "norm_eps", "rope_theta", "head_size", "qk_norm", "qkv_bias",
        "sliding_window", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
        "rope_original_seq_len")
# and of a mixture of experts, what shapes its weights and how they compute (not its training knobs)
SAME_MOE = ("n_experts", "top_k", "expert_ffn_dim", "n_shared_experts", "shared_expert_gate", "router",
            "norm_topk_prob", "first_dense_layers", "every")


CONFIG_MAX_BYTES = 16 * 2**20  # a config.json is a few kB


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")  # Python's json takes NaN and Infinity by default


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """HF_DIR/config.json as an object: a bounded regular file of strict JSON (no NaN, no Infinity),
    or a one-line InteropError."""
    path = hf_dir / "config.json"
    if not (path.is_file() or path.is_symlink()):
        raise InteropError(f"{hf_dir}: no config.json (a Hugging Face model folder has one)")
    try:
        data = json.loads(read_regular(path, CONFIG_MAX_BYTES), parse_constant=_no_constant)
    except OSError as exc:
        raise InteropError(f"{path}: unreadable ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:
        raise InteropError(f"{path}: not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(data, dict):
        raise InteropError(f"{path}: not a JSON object")
    return data


def _nonzero(src: HfTensors, part: str) -> bool:
    """Whether any bias of a GPT-NeoX checkpoint whose name holds `part` is not all zeros."""
    return any(src.get(n).count_nonzero() for n in sorted(src.names) if part in n and n.endswith(".bias"))


def hf_model_config(hf_dir: Path) -> ModelConfig:
    """The mshpc model of the Hugging Face folder `hf_dir`, whose safetensors files must open;
    with MLP (qkv) biases when a GPT-NeoX checkpoint's are not all zero."""
    m = checked_model(model_config(read_hf_config(hf_dir), str(hf_dir)), str(hf_dir))
    with read_safetensors(hf_dir) as src:
        if m.mlp != "gelu":  # GPT-NeoX's biases may be zeros: kept only where they are not
            return m
        return dataclasses.replace(m, mlp_bias=_nonzero(src, ".mlp.dense_"),
                                   qkv_bias=_nonzero(src, ".attention.query_key_value"))


def checked_model(m: ModelConfig, where: str) -> ModelConfig:
    """`m` if it passes the config's own checks (ranges, divisibility, the memory it would take),
    else the config's one-line reason as an InteropError naming the folder."""
    try:
        from_dict({"model": dataclasses.asdict(m)})
    except ConfigError as exc:
        raise InteropError(f"{where}: its config.json gives a model mshpc refuses: {exc}") from None
    return m


def import_config(hf_dir: Path, out: Path) -> Config:
    """Write to `out` a config whose model is `hf_dir`'s and whose training starts from its
    weights (train.init_from), every other key at its default; return it."""
    m = hf_model_config(hf_dir)
    cfg = from_dict({"model": dataclasses.asdict(m),  # the moe section as a nested mapping too
                     "train": {"init_from": str(hf_dir.resolve())}})
    header = (f"# Imported by `mshpc import` from {hf_dir.resolve()}: the model is its config.json's,\n"
              "# the initial weights its safetensors (train.init_from); everything else is a default.\n")
    out.write_text(header + dump_yaml(cfg))
    return cfg


def check_same_model(m: ModelConfig, hf_m: ModelConfig, hf_dir: Path) -> None:
    pairs = [(f"model.{key}", getattr(m, key), getattr(hf_m, key)) for key in SAME]
    pairs.append(("model.moe", m.moe is None, hf_m.moe is None))
    if m.moe is not None and hf_m.moe is not None:
        expert = dataclasses.replace(m.moe, expert_ffn_dim=m.expert_ffn)
        pairs += [(f"model.moe.{key}", getattr(expert, key), getattr(hf_m.moe, key)) for key in SAME_MOE]
    for key, mine, theirs in pairs:
        if mine != theirs:
            what = "null" if key == "model.moe" and mine else repr(mine)
            raise InteropError(f"train.init_from={hf_dir}: its config.json gives {key.removeprefix('model.')}="
                               f"{theirs!r} but the config has {key}={what} (`mshpc import` writes a matching one)")


def load_hf_weights(model: nn.Module, m: ModelConfig, hf_dir: Path) -> None:
    """Copy the weights of the Hugging Face folder `hf_dir` into `model`, a whole GPT of `m`;
    an InteropError when the folder's model is not `m` or a tensor's shape differs."""
    hf = read_hf_config(hf_dir)
    hf_m = model_config(hf, str(hf_dir), m.mlp_bias, m.qkv_bias)
    check_same_model(m, hf_m, hf_dir)
    arch = hf["architectures"][0]
    with read_safetensors(hf_dir) as src:
        weights = from_hf(arch, m, src)
        params = dict(model.named_parameters())
        if set(params) != set(weights):
            missing = sorted(set(params) ^ set(weights))
            raise InteropError(f"train.init_from={hf_dir}: no weight for {missing[0]!r}")
        with torch.no_grad():
            for name, p in params.items():
                if tuple(weights[name].shape) != tuple(p.shape):
                    raise InteropError(f"train.init_from={hf_dir}: {name} is {list(weights[name].shape)}, "
                                       f"the model's is {list(p.shape)}")
                p.copy_(weights[name])
    log.info("initial weights: %s (%s, %d tensors)", hf_dir, arch, len(params))


def initial_model(model_cfg: ModelConfig, init_from: str | None) -> GPT:
    """The whole model training starts from: drawn from the seed (the caller seeds), or read
    from `init_from` (train.init_from). Every rank builds it alike; parallelism then keeps each
    rank's part."""
    model = GPT(model_cfg)
    if init_from is not None:
        load_hf_weights(model, model_cfg, Path(init_from))
    return model
