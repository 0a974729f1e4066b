"""`mshpc generate`: sample text from a checkpoint on one process, whatever layout saved it.

The checkpoint's `model/` copy is read whole at tp=1 by checkpoint/model_copy.py, as `mshpc
export` reads it (a tp-split weight joined from its parts, pipeline stages' weights all under the
full model's names), into the plain GPT. Decoding keeps each layer's keys and values (`KVCache`) so that every new token costs
one position's forward, not the whole sequence's (torchtitan's and nanoGPT's sampling rules:
temperature, then top-k, then top-p).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mshpc.checkpoint.manifest import MANIFEST_FILE
from mshpc.checkpoint.model_copy import read_model_copy
from mshpc.checkpoint.paths import checkpoint_root, committed_steps, latest_step, step_dir
from mshpc.config import Config, ModelConfig, load_config
from mshpc.data.tokenizer import Tokenizer
from mshpc.data.tokenizer_dir import run_tokenizer
from mshpc.errors import CheckpointError, ConfigError
from mshpc.model.attention import KVCache
from mshpc.model.gpt import GPT


@dataclass(frozen=True)
class SampleOptions:
    max_new_tokens: int = 64
    temperature: float = 1.0  # logits / temperature before the softmax
    top_k: int | None = None  # keep the k likeliest tokens
    top_p: float | None = None  # keep the fewest likeliest tokens whose probability reaches p (nucleus)
    seed: int = 0
    greedy: bool = False  # the likeliest token every time: deterministic

    def check(self) -> SampleOptions:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens={self.max_new_tokens} must be >= 1")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature={self.temperature} must be > 0 (use --greedy for the likeliest token)")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"--top-k={self.top_k} must be >= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p={self.top_p} must be in (0, 1]")
        return self


def find_checkpoint(path: Path) -> tuple[Path, Config]:
    """The checkpoint folder and run config for `path`: a run directory (its newest checkpoint),
    a checkpoints root, or one step folder (its run's config.yaml two levels up)."""
    folder, cfg, _ = find_run_checkpoint(path)
    return folder, cfg


def find_run_checkpoint(path: Path) -> tuple[Path, Config, Path]:
    """find_checkpoint's checkpoint folder and config, and the run directory."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist (pass a run directory or a checkpoint folder)")
    if (path / MANIFEST_FILE).exists():
        run_dir = path.resolve().parent.parent
        if not (run_dir / "config.yaml").exists():
            raise CheckpointError(f"{path}: no config.yaml in {run_dir} (pass the run directory, or a checkpoint "
                                  "under <run>/checkpoints/)")
        return path, load_config(run_dir / "config.yaml"), run_dir
    run_dir = path if (path / "config.yaml").exists() else path.parent
    if not (run_dir / "config.yaml").exists():
        raise CheckpointError(f"{path}: neither a run directory (no config.yaml) nor a checkpoint (no {MANIFEST_FILE})")
    cfg = load_config(run_dir / "config.yaml")
    root = path if run_dir != path else checkpoint_root(cfg.checkpoint, run_dir)
    steps = committed_steps(root)
    step = latest_step(root) if latest_step(root) is not None else (steps[-1] if steps else None)
    if step is None:
        raise CheckpointError(f"{root}: no checkpoint yet (set checkpoint.interval_steps and train)")
    return step_dir(root, step), cfg, run_dir


def load_model(folder: Path, model_cfg: ModelConfig) -> GPT:
    """The plain GPT of `model_cfg` with the weights of checkpoint `folder` (its `model/` copy,
    read whole whatever the saved layout), in eval mode."""
    model = GPT(replace(model_cfg, dropout=0.0)).eval()
    weights = read_model_copy(folder)
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = weights.pop(name, None)  # popped: each whole weight is held twice only while copied
            if w is None or w.shape != p.shape:
                got = "nothing" if w is None else list(w.shape)
                raise CheckpointError(f"{folder}: model/{name} is {got} but the run's config has {list(p.shape)}")
            p.copy_(w)
    return model


def next_token(logits: torch.Tensor, opts: SampleOptions, gen: torch.Generator) -> int:
    """One token id drawn from logits (vocab,) by `opts`."""
    if opts.greedy:
        return int(logits.argmax())
    logits = logits / opts.temperature
    if opts.top_k is not None and opts.top_k < logits.numel():
        kth = logits.topk(opts.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = logits.softmax(-1)
    if opts.top_p is not None:
        sorted_p, order = probs.sort(descending=True)
        # drop a token once the likelier ones before it already reach p
        drop = sorted_p.cumsum(-1) - sorted_p >= opts.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def decode(model: GPT, prompt: list[int], opts: SampleOptions, stop_id: int | None = None,
           vocab: int | None = None, cache: bool = True) -> list[int]:
    """The new token ids after `prompt` (at most opts.max_new_tokens, ending at `stop_id`);
    ids from `vocab` up (a padded vocabulary's unused rows) are never drawn. cache=False
    recomputes the whole sequence for every token: the reference the cache must match."""
    if len(prompt) + opts.max_new_tokens > model.cfg.seq_len:
        raise ConfigError(f"a prompt of {len(prompt)} tokens + --max-new-tokens={opts.max_new_tokens} exceeds "
                          f"model.seq_len={model.cfg.seq_len} (choose at most {model.cfg.seq_len - len(prompt)})")
    gen = torch.Generator().manual_seed(opts.seed)
    caches = [KVCache() for _ in model.layers] if cache else None
    ids, new = list(prompt), []
    step_in = ids
    for _ in range(opts.max_new_tokens):
        logits = model(torch.tensor([step_in]), caches=caches)[0, -1]  # (vocab,)
        if vocab is not None:
            logits[vocab:] = -torch.inf
        token = next_token(logits, opts, gen)
        new.append(token)
        if token == stop_id:
            break
        ids.append(token)
        step_in = [token] if cache else ids
    return new


def generate(path: Path, prompt: str, opts: SampleOptions) -> tuple[str, float]:
    """The prompt and its continuation from the checkpoint at `path` (see find_checkpoint), and
    the new tokens per second."""
    if not prompt:
        raise ConfigError("--prompt is empty (give the text to continue)")
    opts.check()
    folder, cfg, run_dir = find_run_checkpoint(path)
    tokenizer: Tokenizer = run_tokenizer(run_dir, cfg.data.tokenizer)  # the one the run trained with
    model = load_model(folder, cfg.model)
    ids = [int(i) for i in tokenizer.encode(prompt)]
    start = time.perf_counter()
    new = decode(model, ids, opts, stop_id=tokenizer.eos_id, vocab=tokenizer.vocab_size)
    tokens_per_s = len(new) / (time.perf_counter() - start)
    return tokenizer.decode(ids + new), tokens_per_s
