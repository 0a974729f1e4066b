"""`mshpc export RUN_OR_CHECKPOINT --hf OUT_DIR`: a checkpoint's whole weights as a Hugging Face
folder (config.json, safetensors, tokenizer) that `from_pretrained(OUT_DIR)` loads.

The weights come from the checkpoint's `model/` copy, checked first and read whole at tp=1 by
checkpoint/model_copy.py (as `mshpc generate` reads it): tp parts joined by the rules in the
manifest, every pp stage's layers under their full-model names. Nothing is written to
OUT_DIR until everything has been read and converted: the folder appears whole or not at all.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mshpc.checkpoint.manifest import MANIFEST_FILE
from mshpc.checkpoint.model_copy import MODEL, check_model_copy, read_model_copy
from mshpc.checkpoint.paths import checkpoint_root, latest_step, step_dir
from mshpc.config import CheckpointConfig, Config, ModelConfig, load_config
from mshpc.data.tokenizer import Tokenizer
from mshpc.data.tokenizer_dir import run_tokenizer
from mshpc.errors import InteropError
from mshpc.interop.hf_arch import hf_architecture, hf_config
from mshpc.interop.hf_names import Weights, to_hf
from mshpc.interop.hf_tokenizer import write_tokenizer
from mshpc.interop.safetensors_files import DEFAULT_SHARD_BYTES, write_safetensors
from mshpc.model.gpt import GPT

CONFIG_FILE = "config.yaml"  # the resolved config, in every run directory (run_dir.py)


def run_config(path: Path, config: Path | None) -> tuple[Path, Config]:
    """The run directory of `path` (itself, or <run dir>/checkpoints/step-N above a checkpoint)
    and the config it was trained with: `config`, or the run directory's config.yaml."""
    if (path / MANIFEST_FILE).is_file():
        run_dir = path.resolve().parent.parent
    elif (path / CONFIG_FILE).is_file():
        run_dir = path
    else:
        raise InteropError(f"{path}: neither a run directory ({CONFIG_FILE}) nor a checkpoint ({MANIFEST_FILE})")
    cfg_path = config or run_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise InteropError(f"{path}: no {CONFIG_FILE} at {run_dir}; name the run's config with --config")
    return run_dir, load_config(cfg_path)


def find_checkpoint(path: Path, run_dir: Path, checkpoint: CheckpointConfig) -> Path:
    """The checkpoint folder `path` names: itself, or the latest under the run directory's
    checkpoint root (`checkpoint.dir`, or <run dir>/checkpoints)."""
    if (path / MANIFEST_FILE).is_file():
        return path
    root = checkpoint_root(checkpoint, run_dir)
    step = latest_step(root)
    if step is None:
        raise InteropError(f"{path}: a run directory with no checkpoint under {root} "
                           "(train with checkpoint.interval_steps > 0)")
    return step_dir(root, step)


def check_shapes(weights: Weights, m: ModelConfig, folder: Path) -> Weights:
    """`weights` as the config's whole model has them (a pipeline's second copy of a tied
    embedding dropped), or an InteropError for a missing, extra or misshapen one."""
    with torch.device("meta"):
        want = {n: tuple(p.shape) for n, p in GPT(m).named_parameters()}
    for name, shape in want.items():
        if name not in weights:
            raise InteropError(f"{folder}: has no {MODEL}{name}; is the config the run's?")
        if tuple(weights[name].shape) != shape:
            raise InteropError(f"{folder}: {MODEL}{name} is {list(weights[name].shape)} but the config's "
                               f"model has {list(shape)}; is the config the run's?")
    extra = sorted(set(weights) - set(want) - ({"lm_head.weight"} if m.tie_embeddings else set()))
    if extra:
        raise InteropError(f"{folder}: {MODEL}{extra[0]} has no place in the config's model; is the config the run's?")
    return {n: weights[n] for n in want}


def _fresh_dir(out_dir: Path) -> Path:
    """A staging folder beside `out_dir`, which must be absent or empty (nothing is overwritten)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InteropError(f"{out_dir} exists and is not an empty folder; export into a new one")
    staging = out_dir.with_name(out_dir.name + ".export-tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def write_hf(out_dir: Path, m: ModelConfig, weights: Weights, tokenizer: Tokenizer,
             max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write the whole weights `weights` of model `m`, and the run's `tokenizer`, as a Hugging Face
    folder `out_dir` (new or empty); the files written."""
    arch = hf_architecture(m)
    dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    tensors = to_hf(arch, m, weights)
    staging = _fresh_dir(out_dir)
    try:  # the tokenizer first: a converted one that gives other ids stops the export before the weights
        eos_id, tokenizer_line = write_tokenizer(tokenizer, staging, m.seq_len)
        files = write_safetensors(staging, tensors, max_shard_bytes)
        (staging / "config.json").write_text(json.dumps({**hf_config(m, dtype), "eos_token_id": eos_id},
                                                        indent=2) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked by _fresh_dir
    staging.rename(out_dir)
    return [f"weights: {', '.join(files)}", tokenizer_line]


def export_hf(path: Path, out_dir: Path, config: Path | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Export the checkpoint `path` names (a run directory's latest, or a step folder) into `out_dir`; lines saying what was written."""
    run_dir, cfg = run_config(path, config)
    arch = hf_architecture(cfg.model)  # before reading anything: an unsupported model stops here
    folder = find_checkpoint(path, run_dir, cfg.checkpoint)
    check_model_copy(folder)
    weights = check_shapes(read_model_copy(folder), cfg.model, folder)
    tokenizer = run_tokenizer(run_dir, cfg.data.tokenizer)  # the one the run trained with
    lines = write_hf(out_dir, cfg.model, weights, tokenizer, max_shard_bytes)
    n_params = sum(t.numel() for t in weights.values())
    dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    return [f"exported {folder} ({n_params / 1e6:.1f}M parameters, {dtype}) as {arch} to {out_dir}", *lines]
