"""Claim: the token loader delivers batches far faster than the tiny model consumes them, so
the train step never waits on data. Measures both in one run; prints one JSON line.

    .venv/bin/python benchmarks/dataloader.py [--config configs/tiny.yaml] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mshpc.config import load_config, resolve_world
from mshpc.data.loader import build_loader
from mshpc.data.prepare import dataset_path
from mshpc.data.shards import TokenDataset
from mshpc.model.gpt import GPT, loss_fn
from mshpc.parallel.zero import build_zero_engine
from mshpc.train import Runtime, train_step

REPO = Path(__file__).resolve().parents[1]


def loader_tokens_per_s(cfg, dataset: TokenDataset, batches: int) -> float:
    """Drain the loader as fast as it fills: its own throughput, one background thread."""
    with build_loader(dataset, cfg.model.seq_len, cfg.global_batch, 0, 1, cfg.data.seed, 0,
                      cfg.data.prefetch_batches) as loader:
        next(loader)  # thread started, first batch ready
        start = time.perf_counter()
        for _ in range(batches):
            next(loader)
        elapsed = time.perf_counter() - start
    return batches * cfg.global_batch * cfg.model.seq_len / elapsed


def model_tokens_per_s(cfg, dataset: TokenDataset, steps: int) -> float:
    """Full train steps (forward, backward, optimizer) of the model on this machine's CPU."""
    torch.manual_seed(cfg.train.seed)
    engine = build_zero_engine(GPT(cfg.model), cfg.optim, cfg.parallel)
    rt = Runtime(device=torch.device("cpu"), autocast_dtype=None, peak_tflops=None)
    with build_loader(dataset, cfg.model.seq_len, cfg.global_batch, 0, 1, cfg.data.seed, 0,
                      cfg.data.prefetch_batches) as loader:
        train_step(engine, loss_fn, next(loader), cfg, rt)  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            train_step(engine, loss_fn, next(loader), cfg, rt)
        elapsed = time.perf_counter() - start
    return steps * cfg.global_batch * cfg.model.seq_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(REPO / "configs/tiny.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    # One rank with the tiny config's per-rank batch: what each rank's loader must keep up with.
    cfg = resolve_world(load_config(args.config, ["parallel.dp=1"]), 1)
    dataset = TokenDataset.open(dataset_path(cfg.data), verify=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    consumed = model_tokens_per_s(cfg, dataset, args.steps)
    delivered = loader_tokens_per_s(cfg, dataset, batches=max(200, 10 * args.steps))
    dist.destroy_process_group()
    print(json.dumps({
        "bench": "dataloader", "metric": "loader_tokens_per_s_vs_model_consumption",
        "value": round(delivered), "unit": "tokens/s", "baseline": round(consumed),
        "ratio": round(delivered / consumed, 2), "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
