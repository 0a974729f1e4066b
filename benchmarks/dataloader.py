"""Claims: (1) the token loader delivers batches far faster than the tiny model consumes them, so
the train step never waits on data; (2) one reader per node delivers what one reader per GPU
does, reading each batch once per node instead of once per rank that needs it, in less host
memory; DALI (where it runs) is measured beside them. One run, side by side; JSON lines.

(2) starts `--ranks` local processes as one node (gloo, tp innermost as in the mesh) three
times: every rank its own torch loader ("per-GPU readers"), `data.per_node_reader`, and every
rank its own DALI pipeline. Each drains `--batches` batches as fast as it can. Measured per
node: tokens/s delivered; shard bytes the ranks copied out of the token files (counted) and
bytes read from storage (/proc/<pid>/io read_bytes, the token files first evicted from the page
cache); host memory (PSS and RSS from /proc/<pid>/smaps_rollup, and the PSS the loader added).

    .venv/bin/python benchmarks/dataloader.py [--config configs/tiny.yaml] [--steps 20]
                                              [--ranks 4] [--tp 2] [--batches 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from mshpc.bench import harness
from mshpc.bench.harness import REPO
from mshpc.config import Config, load_config, resolve_world
from mshpc.data.dali_source import dali_missing
from mshpc.data.node_reader import ReaderScope
from mshpc.data.pipeline import build_loader
from mshpc.data.prepare import dataset_path
from mshpc.data.shards import TokenDataset
from mshpc.launch.runtime import Runtime
from mshpc.model.gpt import GPT, loss_fn
from mshpc.parallel.zero_build import build_zero_engine
from mshpc.train import train_step

MODES = {"per_gpu": {"loader": "torch"}, "per_node": {"per_node_reader": True}, "dali": {"loader": "dali"}}


def loader_tokens_per_s(cfg: Config, dataset: TokenDataset, batches: int) -> float:
    """Drain the torch loader as fast as it fills: its own throughput, one background thread."""
    data = dataclasses.replace(cfg.data, loader="torch")
    with build_loader(data, dataset, cfg.model.seq_len, cfg.global_batch, 0, 1, 0) as loader:
        next(loader)  # thread started, first batch ready
        start = time.perf_counter()
        for _ in range(batches):
            next(loader)
        elapsed = time.perf_counter() - start
    return batches * cfg.global_batch * cfg.model.seq_len / elapsed


def model_tokens_per_s(cfg: Config, dataset: TokenDataset, steps: int) -> float:
    """Full train steps (forward, backward, optimizer) of the model on this machine's CPU."""
    torch.manual_seed(cfg.train.seed)
    engine = build_zero_engine(GPT(cfg.model), cfg.optim, cfg.parallel)
    rt = Runtime(device=torch.device("cpu"), autocast_dtype=None, peak_tflops=None)
    data = dataclasses.replace(cfg.data, loader="torch")
    with build_loader(data, dataset, cfg.model.seq_len, cfg.global_batch, 0, 1, 0) as loader:
        sections = {"train": cfg.train, "optim": cfg.optim, "parallel": cfg.parallel}
        train_step(engine, loss_fn, next(loader), rt, **sections)  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            train_step(engine, loss_fn, next(loader), rt, **sections)
        elapsed = time.perf_counter() - start
    return steps * cfg.global_batch * cfg.model.seq_len / elapsed


# ------------------------------------------------------------------ one node of reader ranks


def memory_kb() -> dict[str, int]:
    """This process's proportional and resident set sizes (kB)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return {"pss": int(fields["Pss"].split()[0]), "rss": int(fields["Rss"].split()[0])}


def storage_read_bytes() -> int:
    """Bytes this process caused to be read from storage (page-cache hits do not count)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def counted(dataset: TokenDataset) -> list[int]:
    """Count the bytes copied out of the shards, by wrapping this instance's reads."""
    total = [0]
    read = dataset.tokens

    def tokens(start: int, length: int):
        total[0] += length * dataset.dtype.itemsize
        return read(start, length)

    dataset.tokens = tokens  # type: ignore[method-assign]
    return total


def evict(dataset_dir: Path) -> None:
    """Drop the token files from the page cache (only ours), so reads come from storage."""
    for path in dataset_dir.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drain(cfg: Config, mode: str, rank: int, world: int, tp: int, batches: int) -> dict[str, float]:
    """Rank `rank`'s part of one node's run; collective over the world (gloo)."""
    dataset = TokenDataset.open(dataset_path(cfg.data), verify=False)
    shard_bytes = counted(dataset)
    data = dataclasses.replace(cfg.data, **MODES[mode])
    dp = world // tp
    local_batch = cfg.global_batch // dp
    dist.barrier()
    before, io_before = memory_kb(), storage_read_bytes()
    with build_loader(data, dataset, cfg.model.seq_len, cfg.global_batch, rank // tp, dp, 0,
                      scope=ReaderScope(node="bench")) as loader:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(batches):
            next(loader)
        elapsed = time.perf_counter() - start
        after = memory_kb()
        dist.barrier()  # the reader keeps serving until every rank has its batches
    return {"elapsed_s": elapsed, "tokens": batches * local_batch * cfg.model.seq_len,
            "shard_bytes": shard_bytes[0], "storage_bytes": storage_read_bytes() - io_before,
            "pss_kb": after["pss"], "rss_kb": after["rss"], "loader_pss_kb": after["pss"] - before["pss"]}


def rank_main(cfg_args: tuple[str, list[str]], mode: str, rank: int, world: int, tp: int,
              batches: int, store: str, conn: Connection) -> None:
    torch.set_num_threads(1)
    cfg = resolve_world(load_config(*cfg_args), world)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    try:
        conn.send_bytes(json.dumps(drain(cfg, mode, rank, world, tp, batches)).encode())
    finally:
        dist.destroy_process_group()


def run_node(cfg_args: tuple[str, list[str]], mode: str, world: int, tp: int,
             batches: int) -> dict[str, float]:
    """One node's totals for `mode`: `world` spawned ranks."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="mshpc-bench-") as tmp:
        pipes, procs = [], []
        for rank in range(world):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=rank_main, args=(cfg_args, mode, rank, world, tp, batches,
                                                       str(Path(tmp, "store")), send))
            proc.start()
            send.close()
            pipes.append(recv)
            procs.append(proc)
        ranks = [json.loads(p.recv_bytes()) for p in pipes]
        for proc in procs:
            proc.join()
    node = {k: sum(r[k] for r in ranks) for k in ("tokens", "shard_bytes", "storage_bytes",
                                                  "pss_kb", "rss_kb", "loader_pss_kb")}
    node["tokens_per_s"] = node["tokens"] / max(r["elapsed_s"] for r in ranks)
    return node


def line(metric: str, value: float, unit: str, baseline: float, **extra: object) -> dict:
    if not baseline:  # nothing read by the baseline: no ratio
        return {**harness.record("dataloader", metric, value, unit, digits=1), "baseline": baseline, "ratio": None,
                **extra}
    return harness.record("dataloader", metric, value, unit, baseline, digits=1, **extra)


def compare_readers(cfg_args: tuple[str, list[str]], dataset_dir: Path, world: int, tp: int,
                    batches: int) -> list[dict]:
    modes = ["per_gpu", "per_node"] + (["dali"] if dali_missing() is None else [])
    nodes = {}
    for mode in modes:
        evict(dataset_dir)
        nodes[mode] = run_node(cfg_args, mode, world, tp, batches)
    base = nodes["per_gpu"]
    extra = {"ranks": world, "tp": tp, "batches_per_rank": batches}
    out = []
    for mode in modes[1:]:
        node = nodes[mode]
        out += [line(f"{mode}_tokens_per_s_vs_per_gpu_readers", node["tokens_per_s"], "tokens/s",
                     base["tokens_per_s"], **extra),
                line(f"{mode}_shard_bytes_read_vs_per_gpu_readers", node["shard_bytes"], "bytes",
                     base["shard_bytes"], **extra),
                line(f"{mode}_storage_read_bytes_vs_per_gpu_readers", node["storage_bytes"], "bytes",
                     base["storage_bytes"], **extra),
                line(f"{mode}_loader_pss_mb_vs_per_gpu_readers", node["loader_pss_kb"] / 1024, "MiB",
                     base["loader_pss_kb"] / 1024, **extra),
                line(f"{mode}_node_pss_mb_vs_per_gpu_readers", node["pss_kb"] / 1024, "MiB",
                     base["pss_kb"] / 1024, rss_mb=round(node["rss_kb"] / 1024),
                     baseline_rss_mb=round(base["rss_kb"] / 1024), **extra)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(REPO / "configs/tiny.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    # One rank with the tiny config's per-rank batch: what each rank's loader must keep up with.
    cfg = resolve_world(load_config(args.config, ["parallel.dp=1"]), 1)
    dataset = TokenDataset.open(dataset_path(cfg.data), verify=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    consumed = model_tokens_per_s(cfg, dataset, args.steps)
    delivered = loader_tokens_per_s(cfg, dataset, batches=max(200, 10 * args.steps))
    dist.destroy_process_group()
    harness.emit(harness.record("dataloader", "loader_tokens_per_s_vs_model_consumption", round(delivered),
                                "tokens/s", round(consumed), digits=0, threads=torch.get_num_threads(),
                                load_avg=harness.load_average()))
    dataset.close()  # the reader comparison below opens the shards itself
    cfg_args = (args.config, [f"parallel.tp={args.tp}"])
    for out in compare_readers(cfg_args, dataset_path(cfg.data), args.ranks, args.tp, args.batches):
        harness.emit(out)


if __name__ == "__main__":
    main()
