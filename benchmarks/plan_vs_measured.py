"""Claim: `mshpc plan`'s step-time model, fed with this machine's own measured GEMM rate,
memory bandwidth and collective bus bandwidth, predicts the tiny config's measured step time.
Measures the inputs, predicts, trains for real, all in one run; prints one JSON line per layout
with ratio = predicted / measured.

    .venv/bin/python benchmarks/plan_vs_measured.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mshpc.bench import harness
from mshpc.bench.harness import REPO
from mshpc.config import load_config
from mshpc.parallel import comm
from mshpc.plan.devices import DeviceSpec
from mshpc.plan.layout import layout_of
from mshpc.plan.steptime import step_time
from mshpc.run_dir import read_metrics

CONFIG = REPO / "configs/tiny.yaml"
COMM_BYTES = 8 * 2**20
# the layouts this machine's 2 cores can run side by side; the pipeline needs micro-batches
LAYOUTS = {
    "dp1": ["parallel.dp=1"],
    "dp2": ["parallel.dp=2"],
    "tp2": ["parallel.dp=1", "parallel.tp=2"],
    "pp2": ["parallel.dp=1", "parallel.pp=2", "train.grad_accum=4", "train.micro_batch=2"],
}


def gemm_tflops(threads: int, rows: int, d_model: int, mlp_ratio: int) -> float:
    """fp32 matmul rate at the model's own shapes: (tokens, d) x (d, r*d) and back."""
    torch.set_num_threads(threads)
    x = torch.randn(rows, d_model)
    w1, w2 = torch.randn(d_model, mlp_ratio * d_model), torch.randn(mlp_ratio * d_model, d_model)
    for _ in range(3):
        x @ w1 @ w2
    n, start = 30, time.perf_counter()
    for _ in range(n):
        x @ w1 @ w2
    return n * 2 * 2 * rows * d_model * mlp_ratio * d_model / (time.perf_counter() - start) / 1e12


def copy_gbps() -> float:
    src, dst = torch.randn(64 * 2**20 // 4), torch.empty(64 * 2**20 // 4)
    dst.copy_(src)
    n, start = 20, time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    return n * 2 * src.numel() * 4 / (time.perf_counter() - start) / 1e9


def _busbw_rank(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    data = torch.ones(COMM_BYTES // 4)
    shard = torch.empty(data.numel() // 2)
    for _ in range(3):
        comm.reduce_scatter(shard, data)
    n, start = 20, time.perf_counter()
    for _ in range(n):
        comm.reduce_scatter(shard, data)
        comm.all_gather(data, shard)
    elapsed = (time.perf_counter() - start) / (2 * n)
    if rank == 0:
        out.put(json.dumps(COMM_BYTES * 0.5 / elapsed / 1e9))  # busbw factor (n-1)/n
    dist.destroy_process_group()


def busbw_gbps() -> float:
    """The ZeRO engine's own reduce-scatter and all-gather between 2 local gloo ranks."""
    return harness.run_local_ranks(_busbw_rank, 2, ())


def measured_step_s(overrides: list[str], steps: int) -> float:
    """Median step time of a real `mshpc train` run, the first steps left out as warm-up."""
    with tempfile.TemporaryDirectory() as tmp:
        sets = [*overrides, f"train.steps={steps}", f"run.out_dir={tmp}", "run.name=bench",
                "run.progress=none", f"data.cache_dir={REPO / '.cache/mshpc'}"]
        cmd = [sys.executable, "-m", "mshpc", "train", str(CONFIG), *[a for s in sets for a in ("--set", s)]]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
        rows = read_metrics(Path(tmp) / "bench/metrics.jsonl")
        return statistics.median(row["step_time_s"] for row in rows[steps // 3:])


def cpu_spec(threads_per_rank: int, cfg, busbw: float, copy: float) -> DeviceSpec:
    m, rows = cfg.model, cfg.train.micro_batch * cfg.model.seq_len
    peak = gemm_tflops(threads_per_rank, rows, m.d_model, m.mlp_ratio)
    return DeviceSpec("CPU", peak, 24.0, copy, busbw, busbw, gemm_efficiency=1.0, act_bytes=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    busbw, copy = busbw_gbps(), copy_gbps()
    for name, layout in LAYOUTS.items():
        cfg = load_config(CONFIG, layout)
        ranks = cfg.world_size
        overrides = [*layout, f"train.cpu_threads={max(1, cores // ranks)}"]
        cfg = load_config(CONFIG, overrides)
        dev = cpu_spec(max(1, cores // ranks), cfg, busbw, copy)
        predicted = step_time(layout_of(cfg.parallel, cfg.train), dev, cores, model_cfg=cfg.model,
                              parallel=cfg.parallel).total_s
        measured = measured_step_s(overrides, args.steps)
        harness.emit(harness.record(
            "plan_vs_measured", f"step_time_predicted_vs_measured_{name}", predicted, "s", measured,
            gemm_tflops_per_rank=round(dev.peak_tflops, 4), busbw_gbps=round(busbw, 3), copy_gbps=round(copy, 2),
            load_avg=harness.load_average()))


if __name__ == "__main__":
    main()
