"""Which loader a config gets (`data.loader`, `data.per_node_reader`), built and started."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from mshpc.config import DataConfig
from mshpc.data.dali_source import DaliSource, dali_missing
from mshpc.data.loader import BatchLoader, BatchSource, RankSource
from mshpc.data.node_reader import ReaderScope, start_node_source
from mshpc.data.shards import TokenDataset
from mshpc.data.sources import DataSources
from mshpc.data.window_record import WindowRecord
from mshpc.errors import ConfigError

HOST = torch.device("cpu")  # the default: batches stay in host memory, moved to the device later


def choose_loader(cfg: DataConfig, missing: Callable[[], str | None] = dali_missing) -> tuple[str, str]:
    """(loader, why): "torch", "dali" or "node" (the per-node reader). `missing` says why DALI
    cannot be used here, or None when it can; it is only asked where the choice depends on it."""
    if cfg.per_node_reader:  # config validation already refused data.loader=dali with it
        return "node", "data.per_node_reader=true: one reader per node, batches in shared memory"
    if cfg.loader == "torch":
        return "torch", "data.loader=torch"
    why_not = missing()
    if cfg.loader == "dali":
        if why_not is not None:
            raise ConfigError(f"data.loader='dali' but {why_not} (or choose 'auto' or 'torch')")
        return "dali", "data.loader=dali"
    if why_not is not None:
        return "torch", f"data.loader=auto and {why_not}"
    return "dali", "data.loader=auto and DALI is installed"


def build_loader(cfg: DataConfig, dataset: TokenDataset | DataSources, seq_len: int, global_batch: int,
                 dp_rank: int, dp_size: int, start_step: int,
                 device: torch.device = HOST,
                 scope: ReaderScope | None = None, record: Path | None = None) -> BatchLoader:
    """A started loader of rank `dp_rank`'s batches from `start_step` on, on `device` (DALI) or in
    host memory to be moved there. With `cfg.per_node_reader` it is collective over
    `scope.group` (every rank of it calls this), and `scope` says who shares a reader. With
    `record`, each batch handed out is recorded there (data.record_windows)."""
    name, why = choose_loader(cfg)
    data = dataset if isinstance(dataset, DataSources) else DataSources.single(dataset)
    windows = data.reader(data.sampler(seq_len, global_batch, cfg.seed), dp_size, cfg.doc_mask)
    stop = threading.Event()
    source: BatchSource
    if name == "dali":
        source = DaliSource(windows, dp_rank, start_step, device, cfg.dali_threads)
    elif name == "node":
        if scope is None:
            raise ValueError("data.per_node_reader needs the rank's ReaderScope")
        source = start_node_source(windows, scope, dp_rank, start_step, cfg.prefetch_batches, stop)
    else:
        source = RankSource(windows, dp_rank)
    return BatchLoader(source, start_step, cfg.prefetch_batches, stop, f"{name} ({why})",
                       pin_memory=device.type == "cuda",
                       record=None if record is None else WindowRecord(record, dp_rank))
