"""The rules a config must satisfy besides its types (config.py checks those while loading):
minimums, divisibility between model and parallel sizes, combinations that cannot work. Each
broken rule is a one-line `ConfigError` naming the keys and the valid choices."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from mshpc.errors import ConfigError

if TYPE_CHECKING:  # config.py imports this module to validate what it loads
    from mshpc.config import Config, DiagnoseConfig, ModelConfig


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]


def _check_minimums(section: Any, prefix: str) -> None:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_minimums(value, f"{prefix}{f.name}.")
        elif "min" in f.metadata and value is not None and value < f.metadata["min"]:
            raise ConfigError(f"{prefix}{f.name}={value} must be >= {f.metadata['min']}")


def _check_model(m: ModelConfig) -> None:
    if m.d_model % m.n_head:
        raise ConfigError(
            f"model.n_head={m.n_head} does not divide model.d_model={m.d_model} "
            f"(choose {_divisors(m.d_model)})"
        )
    if (m.d_model // m.n_head) % 2:
        raise ConfigError(
            f"model.d_model/model.n_head={m.d_model // m.n_head} must be even for rotary embeddings"
        )
    if m.sliding_window is not None and m.sliding_window < 1:
        raise ConfigError(f"model.sliding_window={m.sliding_window} must be >= 1 or null (off)")


def _check_parallel(cfg: Config) -> None:
    p, m = cfg.parallel, cfg.model
    if m.n_head % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide model.n_head={m.n_head} (choose {_divisors(m.n_head)})"
        )
    if m.mlp_bias and p.tp > 1:
        # Megatron splits the first bias with fc's rows and adds the second after the
        # reduce-scatter; the tensor-parallel layers here carry no biases yet
        raise ConfigError(f"model.mlp_bias=true is not available with parallel.tp={p.tp} (choose "
                          "model.mlp_bias=false, or parallel.tp=1)")
    if m.seq_len % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide model.seq_len={m.seq_len} (sequence parallelism "
            f"splits the sequence; choose a seq_len that is a multiple of {p.tp})"
        )
    stages = p.pp * p.virtual_stages
    if m.n_layer % stages:
        raise ConfigError(
            f"parallel.pp*parallel.virtual_stages={stages} does not divide "
            f"model.n_layer={m.n_layer} (choose a product among {_divisors(m.n_layer)})"
        )
    if p.virtual_stages > 1 and p.pp == 1:
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.pp > 1 "
                          "(choose virtual_stages 1, or pp >= 2)")
    if p.virtual_stages > 1 and cfg.train.grad_accum % p.pp:
        raise ConfigError(f"interleaved 1F1B needs train.grad_accum={cfg.train.grad_accum} divisible by "
                          f"parallel.pp={p.pp} (choose a multiple of {p.pp}, or virtual_stages 1)")
    if p.bucket_mb <= 0:
        raise ConfigError(f"parallel.bucket_mb={p.bucket_mb} must be > 0 (MiB of fp32 gradients per bucket)")


def _check_diagnose(d: DiagnoseConfig) -> None:
    for key in ("straggler_threshold", "mfu_decline"):
        value = getattr(d, key)
        if not 0 < value < 1:
            raise ConfigError(f"diagnose.{key}={value} must be between 0 and 1 (a fraction)")


def validate(cfg: Config) -> Config:
    """Check every value and combination; return the config unchanged."""
    _check_minimums(cfg, "")
    _check_model(cfg.model)
    _check_parallel(cfg)
    if cfg.data.per_node_reader and cfg.data.loader == "dali":
        raise ConfigError("data.per_node_reader=true reads with the torch reader into shared memory; "
                          "it does not combine with data.loader='dali' (choose 'auto' or 'torch')")
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} must be <= optim.lr={cfg.optim.lr}")
    _check_diagnose(cfg.diagnose)
    return cfg
