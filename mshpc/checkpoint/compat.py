"""Whether this config may resume a checkpoint: the same model (every weight has its place), and,
where `checkpoint.dir` is set and so may be shared, the same run.

Each checkpoint keeps the resolved config it was saved under (`extras["config"]` of its manifest);
its `config_hash` says whether anything changed. A model that differs is refused in one line that
names each differing field, never loaded in part; settings that change no weight (the learning
rate, the steps, the layout) are only named. A checkpoint from before the config was kept is
checked by its weights' names and shapes (`check_weight_names`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mshpc.config import ModelConfig
from mshpc.errors import ConfigError

CONFIG_KEY = "config"  # the manifest extra that holds the resolved config
# What decides the model's weights, their shapes and what they compute together. seq_len,
# dropout, rope settings, the sliding window, init and kernels may change on a resume (a longer
# context, fine-tuning without dropout): no weight moves.
MODEL_FIELDS = ("vocab_size", "n_layer", "n_head", "kv_heads", "d_model", "ffn_width", "norm", "mlp",
                "mlp_bias", "qkv_bias", "parallel_block", "tie_embeddings")
SHOWN_CHANGES = 6  # changed settings named in the resume's one line


class ResumeMismatchError(ConfigError):
    """The checkpoint train.resume would load is not this config's model, or another run's."""


def _how_to_start_fresh(folder: Path) -> str:
    return (f"start fresh with --set train.resume=never or a new run.name, or resume {folder.name} with "
            "its own settings")


def _model_value(model: dict[str, Any], key: str) -> Any:
    """A model field of a saved config's plain model section, derived ones (ffn_width, kv_heads)
    as ModelConfig derives them; None for a field that config predates."""
    if key == "ffn_width":
        return model.get("ffn_dim") or model.get("mlp_ratio", 0) * model.get("d_model", 0)
    if key == "kv_heads":
        return model.get("n_kv_head") or model.get("n_head")
    return model.get(key, getattr(ModelConfig(), key) if key in ("qkv_bias", "mlp_bias") else None)


def _field_name(key: str) -> str:
    return {"ffn_width": "ffn_dim", "kv_heads": "n_kv_head"}.get(key, key)


def model_differences(saved: dict[str, Any], m: ModelConfig) -> list[str]:
    """'model.F=<saved> there, <now> here' for each weight-deciding field that differs."""
    now = dataclasses.asdict(m)
    out = []
    for key in MODEL_FIELDS:
        there, here = _model_value(saved, key), _model_value(now, key)
        if there != here:
            out.append(f"model.{_field_name(key)}={there} there, {here} here")
    return out


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key: <saved> -> <now>' for every setting of two resolved configs (as plain data) that
    differs; a key one side lacks is None."""
    there, here = _flat(saved), _flat(now)
    return [f"{k}: {there.get(k)} -> {here.get(k)}" for k in sorted(set(there) | set(here))
            if there.get(k) != here.get(k)]


def _some(items: list[str]) -> str:
    shown = "; ".join(items[:SHOWN_CHANGES])
    return shown + (f"; and {len(items) - SHOWN_CHANGES} more" if len(items) > SHOWN_CHANGES else "")


def _section(record: dict[str, Any], section: str, key: str) -> Any:
    """record[section][key] of a resolved config as plain data (None where it has none)."""
    value = record.get(section)
    return value.get(key) if isinstance(value, dict) else None


def check_resume(folder: Path, head_hash: str, extras: dict[str, Any], *, config_hash: str,
                 config_record: dict[str, Any], model_cfg: ModelConfig) -> list[str]:
    """Raise ResumeMismatchError when checkpoint `folder` holds another model than `model_cfg`,
    or, where checkpoint.dir is set, another run's checkpoint; else return the settings that
    changed since it was saved (none when its config hash is `config_hash`, this config's).
    `config_record`: this run's resolved config as plain data (config.to_dict)."""
    saved = extras.get(CONFIG_KEY)
    if not isinstance(saved, dict):
        return []  # saved before configs were kept: check_weight_names judges its weights
    if head_hash == config_hash:
        return []
    model = saved.get("model")
    differing = model_differences(model if isinstance(model, dict) else {}, model_cfg)
    if differing:
        raise ResumeMismatchError(f"train.resume: checkpoint {folder} holds another model ({'; '.join(differing)}); "
                                  f"loading it would drop or misplace weights: {_how_to_start_fresh(folder)}")
    changes = config_changes(saved, config_record)
    shared_dir = _section(config_record, "checkpoint", "dir")
    saved_name = _section(saved, "run", "name")
    if shared_dir is not None and saved_name != _section(config_record, "run", "name"):
        raise ResumeMismatchError(
            f"train.resume: checkpoint.dir={shared_dir} holds run {saved_name!r}'s checkpoints "
            f"({folder.name}; this config differs in {_some(changes)}); give this run its own checkpoint.dir, or "
            f"start from it on purpose with --set train.resume={folder}")
    return changes


def check_weight_names(folder: Path, names: Iterable[str], m: ModelConfig, model_names: set[str]) -> None:
    """For a checkpoint that keeps no config: every master weight must be one of the model's
    parameters (`model_names`), or the checkpoint is of a larger or another model."""
    extra = sorted(n.removeprefix("master/") for n in names
                   if n.startswith("master/") and n.removeprefix("master/").split("@")[0] not in model_names)
    if extra:
        raise ResumeMismatchError(f"train.resume: checkpoint {folder} holds weights this config's model has no "
                                  f"place for ({len(extra)}, e.g. {extra[0]!r}; model.n_layer={m.n_layer}, "
                                  f"model.d_model={m.d_model}): {_how_to_start_fresh(folder)}")


def shape_mismatch(folder: Path, name: str, saved: tuple[int, ...], model: tuple[int, ...]) -> ResumeMismatchError:
    """The one line for a weight whose saved shape is not the model's."""
    return ResumeMismatchError(f"train.resume: checkpoint {folder} holds {name} of shape {list(saved)}, this config's "
                               f"model has {list(model)}: {_how_to_start_fresh(folder)}")


def other_run_on_fresh_start(folder: Path, extras: dict[str, Any], *,
                             config_record: dict[str, Any]) -> ResumeMismatchError | None:
    """train.resume never in a set checkpoint.dir whose newest checkpoint `folder` is another
    run's: its saves would prune that run's checkpoints. The error, or None."""
    saved = extras.get(CONFIG_KEY)
    name = _section(saved, "run", "name") if isinstance(saved, dict) else None
    if name is None or name == _section(config_record, "run", "name"):
        return None
    return ResumeMismatchError(f"train.resume=never: checkpoint.dir={_section(config_record, 'checkpoint', 'dir')} "
                               f"holds run {name!r}'s "
                               f"checkpoints ({folder.name}), which this run's saves would prune; give this run its "
                               "own checkpoint.dir")
