"""Which operators a compiled step spends its CPU in (issue #21): mshpc compiled and the compiled
plain-model DDP loop of benchmarks/compile_vs_ddp.py (same weights, same batch, 2 CPU ranks),
profiled one after the other on rank 0 (torch.profiler, operators' self CPU time on the calling
thread), grouped as GEMMs, attention, mshpc's fused kernels, inductor's generated code,
communication launches and the rest; with the GEMMs' achieved GFLOP/s (2mkn per `aten::mm`
from its recorded shapes). It shows how much of a step either engine or kernel work can still
change: the GEMMs are the same in both contenders.

    .venv/bin/python benchmarks/compile_ops.py [--shape tiny] [--micro-batch 8] [--steps 6] [--top 25]
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

from compile_vs_ddp import build_steps  # a sibling benchmark: Python puts benchmarks/ first on the path

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S

CONTENDERS = ("mshpc_compiled", "ddp_compiled_plain")
WARM_UP_STEPS = 3  # the first compiles; the next settle the allocator


def category(name: str) -> str:
    if name in ("aten::mm", "aten::addmm", "aten::bmm"):
        return "gemm"
    if "scaled_dot_product" in name:
        return "attention"
    if name.startswith("mshpc::"):
        return "mshpc_kernels"
    if "CompiledFxGraph" in name:
        return "inductor_code"
    if name.startswith("c10d::"):
        return "comm_launch"
    return "other"


def gemm_flops(shapes: list) -> int:
    (m, k), (_, n) = shapes[0], shapes[1]
    return 2 * m * k * n


def profile_steps(step, finish, steps: int, top: int) -> dict:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
            finish()
    by_category: dict[str, float] = {}
    by_name: dict[str, float] = {}
    gemm_s = gemm_flop = 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        by_name[event.key] = by_name.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
        seconds = event.self_cpu_time_total / 1e6
        by_category[category(event.key)] = by_category.get(category(event.key), 0.0) + seconds
        if event.key == "aten::mm":
            gemm_s += seconds
            gemm_flop += gemm_flops(event.input_shapes) * event.count
    total = sum(by_category.values())
    return {"self_cpu_s_per_step": round(total / steps, 4),
            "share": {k: round(v / total, 4) for k, v in sorted(by_category.items())},
            "ms_per_step": {k: round(1e3 * v / steps, 2) for k, v in sorted(by_category.items())},
            "gemm_gflop_per_s": round(gemm_flop / gemm_s / 1e9, 1) if gemm_s else None,
            "top_ms_per_step": {k: round(1e3 * v / steps, 2)
                                for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]}}


def worker(rank: int, port: int, args: argparse.Namespace, out) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.config import load_config

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    cfg = load_config(REPO / f"configs/{args.shape}.yaml", ["parallel.dp=2"])
    steps = build_steps(cfg, rank, args.micro_batch, CONTENDERS)
    for step, finish in steps.values():
        for _ in range(WARM_UP_STEPS):
            step()
            finish()
    lines = []
    for name, (step, finish) in steps.items():  # both ranks profile the same contender at once
        result = profile_steps(step, finish, args.steps, args.top)
        lines.append({"bench": "compile_ops", "contender": name, "shape": args.shape,
                      "micro_batch_per_rank": args.micro_batch, "steps": args.steps, **result})
    if rank == 0:
        out.put(json.dumps(lines))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=6, help="profiled steps per contender")
    parser.add_argument("--top", type=int, default=25, help="operators listed by name, heaviest first")
    args = parser.parse_args()
    for line in harness.run_local_ranks(worker, 2, (args,)):
        harness.emit(line)


if __name__ == "__main__":
    main()
