"""What a run reads (`data.path` or the blend of `data.sources`), and the tokenizer it adopts.

A source is a dataset folder of `mshpc prepare` (with its `val/` split) or a Megatron .bin/.idx
pair (its held-out split: the last `data.indexed_val_fraction` of its documents). A dataset keeps
the tokenizer it was prepared with: with `data.tokenizer: auto` the run adopts it, and a
`data.tokenizer` that names another is refused in one line, as are sources that disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mshpc.config import DataConfig
from mshpc.data.blend import BlendSampler
from mshpc.data.indexed import IndexedTokens, indexed_prefix
from mshpc.data.prepare import dataset_path, val_path
from mshpc.data.sampler import SequenceSampler
from mshpc.data.shards import INDEX_FILE, TokenDataset, read_index
from mshpc.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer
from mshpc.data.tokenizer_dir import describe, fingerprint, load_tokenizer_dir
from mshpc.data.window_reader import TokenSource, WindowReader, WindowSampler
from mshpc.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataSources:
    """Opened token sources with their blend weights, and the ids they hold: `eos_id` ends a
    document; `id_limit` (model.vocab_size), when set, bounds every id read."""

    sources: list[TokenSource]
    weights: list[float]
    eos_id: int
    id_limit: int | None = None

    @classmethod
    def single(cls, dataset: TokenDataset) -> DataSources:
        return cls([dataset], [1.0], dataset.eos_id)

    def sampler(self, seq_len: int, global_batch: int, seed: int, shuffle: bool = True) -> WindowSampler:
        """One source: its own sampler (the windows of a plain data.path run, unchanged); a blend's
        otherwise."""
        if len(self.sources) == 1:
            return SequenceSampler(self.sources[0].n_tokens, seq_len, global_batch, seed, shuffle)
        return BlendSampler([s.n_tokens for s in self.sources], self.weights, seq_len, global_batch, seed, shuffle)

    def reader(self, sampler: WindowSampler, dp_size: int, doc_mask: bool) -> WindowReader:
        return WindowReader(self.sources, sampler, dp_size, self.eos_id if doc_mask else None, self.id_limit)

    def close(self) -> None:
        for source in self.sources:
            source.close()


def source_paths(cfg: DataConfig) -> list[tuple[Path, float]]:
    """(path, weight) of every source; the embedded corpus is prepared here when it is the one."""
    if cfg.sources:
        paths = [(Path(s.path), s.weight) for s in cfg.sources]
    elif cfg.path is not None and indexed_prefix(Path(cfg.path)) is not None:
        paths = [(Path(cfg.path), 1.0)]
    else:
        return [(dataset_path(cfg), 1.0)]
    for i, (path, _) in enumerate(paths):
        if indexed_prefix(path) is None and not (path / INDEX_FILE).is_file():
            key = f"data.sources[{i}].path" if cfg.sources else "data.path"
            raise DataError(f"{key}={path} is neither a dataset folder of mshpc prepare nor a Megatron "
                            ".bin/.idx pair (its prefix, or either file)")
    return paths


def dataset_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer the dataset `folder` was prepared with."""
    ds = TokenDataset.open(folder, verify=False)
    try:
        if ds.tokenizer_dir is not None:
            return load_tokenizer_dir(ds.tokenizer_dir)
        if ds.tokenizer == "byte":
            return ByteTokenizer()
        if Path(ds.tokenizer).exists():  # prepared before datasets kept their tokenizer
            return build_tokenizer(ds.tokenizer)
        raise DataError(f"dataset {folder} was prepared with tokenizer {ds.tokenizer}, which is not here and which "
                        "it does not keep (prepare it again)")
    finally:
        ds.close()


def adopt_tokenizer(cfg: DataConfig, paths: Sequence[tuple[Path, float]]) -> Tokenizer:
    """The run's tokenizer: the one the datasets keep (they must agree), or data.tokenizer, which
    must then be theirs; a Megatron pair records none, so data.tokenizer names it."""
    kept = [(p, dataset_tokenizer(p)) for p, _ in paths if indexed_prefix(p) is None]
    if cfg.tokenizer == "auto":
        if not kept:
            raise ConfigError(f"data.tokenizer=auto, but {paths[0][0]} is a Megatron .bin/.idx pair, which records "
                              "no tokenizer: set data.tokenizer to the one that made it")
        chosen = kept[0][1]
    else:
        chosen = build_tokenizer(cfg.tokenizer)
    for path, tokenizer in kept:
        if fingerprint(tokenizer) != fingerprint(chosen):
            if cfg.tokenizer == "auto":
                raise DataError(f"data sources disagree: {kept[0][0]} holds ids of {describe(chosen)}, {path} of "
                                f"{describe(tokenizer)} (prepare them with one tokenizer)")
            raise ConfigError(f"data.tokenizer={cfg.tokenizer!r} is not the tokenizer {path} was prepared with "
                              f"({describe(tokenizer)}): leave data.tokenizer at auto to adopt it, or prepare the "
                              f"data again with --tokenizer {cfg.tokenizer}")
    return chosen


def _open(path: Path, part: str, cfg: DataConfig, verify: bool, tokenizer: Tokenizer | None) -> TokenSource:
    prefix = indexed_prefix(path)
    if prefix is not None:
        tokenizer = tokenizer or build_tokenizer(cfg.tokenizer)
        return IndexedTokens(prefix, part, cfg.indexed_val_fraction, tokenizer.eos_id, tokenizer.vocab_size)
    folder = path if part == "train" else val_path(path)
    if part == "val" and not (folder / INDEX_FILE).is_file():
        raise DataError(f"eval.interval_steps > 0 needs a validation split, and {folder} has none "
                        f"(re-run mshpc prepare with --val-fraction F or --val FILES, or set "
                        f"eval.interval_steps=0)")
    return TokenDataset.open(folder, verify=verify)


def _eos_id(cfg: DataConfig, paths: Sequence[tuple[Path, float]]) -> int:
    """The end-of-document id of the sources (checked alike by adopt_tokenizer on rank 0)."""
    for path, _ in paths:
        if indexed_prefix(path) is None:
            return int(read_index(path)["eos_id"])
    return build_tokenizer(cfg.tokenizer).eos_id


def open_sources(cfg: DataConfig, paths: Sequence[tuple[Path, float]], part: str = "train",
                 verify: bool = False, id_limit: int | None = None) -> DataSources:
    """The `part` ("train" or "val") of every source, opened; zero-weight sources are left out."""
    used = [(p, w) for p, w in paths if w > 0]
    tokenizer = None
    if any(indexed_prefix(p) is not None for p, _ in used) and cfg.tokenizer != "auto":
        tokenizer = build_tokenizer(cfg.tokenizer)
    eos_id = tokenizer.eos_id if tokenizer is not None else _eos_id(cfg, used)
    sources = [_open(p, part, cfg, verify, tokenizer) for p, _ in used]
    return DataSources(sources, [w for _, w in used], eos_id, id_limit)


def log_blend(data: DataSources, paths: Sequence[tuple[Path, float]], sampler: WindowSampler, steps: int) -> None:
    """Rank 0's word on each source: its share of the windows and how many epochs of it the run sees."""
    if not isinstance(sampler, BlendSampler):
        return
    used = [p for p, w in paths if w > 0]
    for path, weight, share, epochs, inner in zip(used, sampler.weights, sampler.per_block, sampler.epochs(steps),
                                                  sampler.samplers, strict=True):
        log.info("data source %s: weight %.4f, %.2f%% of the windows, %.2f epochs of its %d windows in %d steps",
                 path, weight, 100 * share / sum(sampler.per_block), epochs, inner.n_windows, steps)

