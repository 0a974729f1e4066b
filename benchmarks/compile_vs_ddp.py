"""Claim (issue #21): with `train.compile`, mshpc's engine (ZeRO-2 with overlapped buckets, the
fused kernels, each block compiled) trains at >= 1.1x the tokens/s of a plain torch DDP loop of
the same model compiled the same way, on 2 CPU ranks, at the tiny and gpt-125m shapes.

Five contenders on identical weights and batches, in one run, taking turns within each round
(mshpc.bench.harness.time_rounds) so that a noisy neighbour slows all alike: mshpc eager and compiled
(parallel/apply.py: blocks compiled after tp and before ZeRO), plain DDP (torch's
DistributedDataParallel, torch's foreach AdamW, clip_grad_norm_) eager and compiled (the same
per-block torch.compile, applied before DDP wraps the model) on mshpc's model with its fused
kernels, and `ddp_compiled_plain`: DDP compiled on the model written in plain torch
(model.fused_kernels=off: the reference operators, which inductor fuses itself), the loop a
torchtitan user writes. Against ddp_compiled the engine alone is measured; against
ddp_compiled_plain the engine and the kernels. The gpt-125m shape keeps its width and depth
but trains short windows (--seq-125m) so a round takes seconds, not minutes; its copies of the
model with their optimizer states do not fit two ranks in this machine's memory all at once, so
there pairs run one after the other (mshpc compiled vs each compiled DDP, eager vs eager), each
pair interleaved.

The machine these runs share is often loaded far past its 2 cores, and then wall time swings
several-fold from run to run; so each contender's CPU time per step is measured too (rank 0's
whole process, gloo's threads included: `time.process_time`), which a neighbour's load barely
moves, and reported as tokens per CPU-second beside tokens/s, with the load average at the start
and the end of each shape; and the minor page faults per step of each. All contenders share their
process's heap, so all run under mshpc's host-memory setting (mshpc/cpu_ranks/heap.py: freed memory
stays in the heap, `"heap_kept": true` in each line), which a CPU rank's start-up applies process-wide;
with `GLIBC_TUNABLES` set (e.g. `GLIBC_TUNABLES=glibc.malloc.check=0`, a no-op tunable) mshpc
leaves the allocator alone and all run under glibc's defaults, as a plain torch script does
(`"heap_kept": false`). Each ratio comes with a 90% interval from resampling the rounds:
at tiny a step is a quarter of a second, and 4 rounds of 2 steps read 1.135x and 1.064x in two
quiet runs, so tiny takes many rounds. One command for both shapes (about 10 minutes on a quiet
machine, 8.5 of them gpt-125m's three pairs), and tiny alone with enough rounds to settle (about
3 minutes):

    .venv/bin/python benchmarks/compile_vs_ddp.py --rounds 4
    .venv/bin/python benchmarks/compile_vs_ddp.py --shapes tiny --rounds 20 --steps 4

    .venv/bin/python benchmarks/compile_vs_ddp.py [--shapes tiny,gpt-125m] [--rounds 3]
        [--steps 2] [--micro-batch 8] [--micro-batch-125m 1] [--seq-125m 64]
        [--only mshpc_eager,mshpc_compiled]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import resource
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S, paired_round_interval, time_rounds

CONTENDERS = ("mshpc_eager", "mshpc_compiled", "ddp_eager", "ddp_compiled", "ddp_compiled_plain")


def build_steps(cfg, rank: int, micro_batch: int, names: tuple[str, ...]) -> dict:
    """(step, finish) per contender, each on a fresh copy of the same model and this rank's batch."""
    import torch

    from mshpc.bench.ddp_baseline import ddp_train_step
    from mshpc.mesh_shape import MeshShape
    from mshpc.model.gpt import GPT, loss_fn
    from mshpc.parallel.apply import parallelize
    from mshpc.parallel.compile_blocks import apply_compile
    from mshpc.parallel.mesh import build_mesh

    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len + 1), generator=gen)
    x, y = batch[:, :-1], batch[:, 1:]
    mesh = build_mesh(MeshShape(pp=1, dp=2, tp=1))

    def fresh(fused_kernels: str = cfg.model.fused_kernels) -> GPT:
        torch.manual_seed(0)  # the same weights whichever operators run them
        return GPT(dataclasses.replace(cfg.model, fused_kernels=fused_kernels))

    def mshpc_step(compiled: bool) -> tuple[Callable[[], None], Callable[[], None]]:
        run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=compiled))
        engine = parallelize(fresh(), mesh, model_cfg=run_cfg.model, parallel=run_cfg.parallel, train=run_cfg.train,
                             optim=run_cfg.optim).engine

        def step() -> None:
            engine.backward(loss_fn(engine.model(x), y))
            engine.step(cfg.optim.grad_clip)
        return step, engine.wait_params

    def ddp_step(compiled: bool, fused_kernels: str = cfg.model.fused_kernels) -> tuple[Callable[[], None], Callable[[], None]]:
        model = fresh(fused_kernels)
        if compiled:
            apply_compile(model.layers.values(), fused_kernels, torch.device("cpu"), fullgraph=True)
        return ddp_train_step(model, x, y, parallel=cfg.parallel, optim=cfg.optim)

    build = {"mshpc_eager": lambda: mshpc_step(False), "mshpc_compiled": lambda: mshpc_step(True),
             "ddp_eager": lambda: ddp_step(False), "ddp_compiled": lambda: ddp_step(True),
             "ddp_compiled_plain": lambda: ddp_step(True, "off")}
    return {name: build[name]() for name in names}


def worker(rank: int, port: int, shape: str, names: tuple[str, ...], args: argparse.Namespace,
           out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.config import load_config
    from mshpc.cpu_ranks.heap import freed_host_memory_kept
    from mshpc.parallel.compile_blocks import compile_seconds

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    overrides = ["parallel.dp=2"] + ([f"model.seq_len={args.seq_125m}"] if shape == "gpt-125m" else [])
    cfg = load_config(REPO / f"configs/{shape}.yaml", overrides)
    start = time.perf_counter()
    micro_batch = args.micro_batch_125m if shape == "gpt-125m" else args.micro_batch
    steps = build_steps(cfg, rank, micro_batch, names)
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    faults: dict[str, list[int]] = {name: [] for name in steps}
    steps = {name: (cpu_timed(step, cpu[name], faults[name]), finish) for name, (step, finish) in steps.items()}
    # the round-0 warm-up compiles every contender; what it spent is reported, not timed
    times = time_rounds(steps, args.rounds, args.steps)
    warm_up = 1 + args.steps  # round 0's lead-in and steps
    cpu_s = {name: statistics.median(s[warm_up:]) for name, s in cpu.items()}
    faults_per_step = {name: statistics.mean(f[warm_up:]) for name, f in faults.items()}
    if rank == 0:
        out.put(json.dumps({"round_s": times, "cpu_s": cpu_s, "faults": faults_per_step,
                            "heap_kept": freed_host_memory_kept(), "compile_s": compile_seconds(), "wall_s": time.perf_counter() - start,
                            "tokens_per_step": 2 * micro_batch * cfg.model.seq_len, "micro_batch": micro_batch,
                            "seq_len": cfg.model.seq_len, "params": sum(p.numel() for p in steps_params(cfg))}))
    dist.destroy_process_group()


def cpu_timed(step: Callable[[], None], samples: list[float], faults: list[int]) -> Callable[[], None]:
    """`step`, appending the CPU seconds this process spent in each call (all its threads) and
    its minor page faults (memory the allocator gave back to the OS and must fault in again)."""
    def timed() -> None:
        start, faulted = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        samples.append(time.process_time() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    return timed


def steps_params(cfg):
    from mshpc.model.gpt import GPT

    return GPT(cfg.model).parameters()


def run_pair(shape: str, names: tuple[str, ...], args: argparse.Namespace) -> dict:
    try:
        return harness.run_local_ranks(worker, 2, (shape, names, args))
    except SystemExit as exc:  # a rank killed (out of memory, say)
        raise SystemExit(f"compile_vs_ddp: {exc} at {shape}") from None


def run_shape(shape: str, args: argparse.Namespace) -> list[dict]:
    """Each group's step times at `shape`: all contenders interleaved at tiny, pairs at gpt-125m
    where memory is short. A ratio is only taken within a group: across groups it would compare
    different moments of a shared machine."""
    if args.only:
        groups = [tuple(args.only.split(","))]
    elif shape == "tiny":
        groups = [CONTENDERS]
    else:
        groups = [("mshpc_compiled", "ddp_compiled"), ("mshpc_compiled", "ddp_compiled_plain"),
                  ("mshpc_eager", "ddp_eager")]
    results = []
    for names in groups:
        load_start = harness.load_average()
        result = run_pair(shape, names, args)
        result["load_avg"] = [load_start, harness.load_average()]
        results.append(result)
    return results


def lines(shape: str, r: dict) -> list[dict]:
    tps = {name: r["tokens_per_step"] / statistics.median(s) for name, s in r["round_s"].items()}
    # per CPU-second of rank 0's process, both ranks' tokens: the figure load moves least
    tpc = {name: r["tokens_per_step"] / s for name, s in r["cpu_s"].items()}
    context = {"shape": shape, "params": r["params"], "seq_len": r["seq_len"], "micro_batch_per_rank": r["micro_batch"],
               "dp": 2, "device": "cpu", "compile_s_rank0": round(r["compile_s"], 1), "load_avg": r["load_avg"],
               "heap_kept": r["heap_kept"]}

    def line(ours: str, baseline: str) -> dict:
        return {"bench": "compile_vs_ddp", "metric": f"tokens_per_s_{ours}_vs_{baseline}",
                "value": round(tps[ours], 1), "unit": "tokens/s", "baseline": round(tps[baseline], 1),
                "ratio": round(tps[ours] / tps[baseline], 3),
                # tokens/s, so the baseline's step times on top
                "ratio_90pct": [round(v, 3) for v in paired_round_interval(
                    [[t] for t in r["round_s"][baseline]], [[t] for t in r["round_s"][ours]])],
                "rounds": len(r["round_s"][ours]),
                "tokens_per_cpu_s": round(tpc[ours], 1), "baseline_tokens_per_cpu_s": round(tpc[baseline], 1),
                "cpu_ratio": round(tpc[ours] / tpc[baseline], 3),
                "minor_faults_per_step": round(r["faults"][ours]),
                "baseline_minor_faults_per_step": round(r["faults"][baseline]), **context}

    pairs = [("mshpc_compiled", "ddp_compiled"), ("mshpc_compiled", "ddp_compiled_plain"),
             ("mshpc_eager", "ddp_eager"), ("mshpc_compiled", "mshpc_eager"), ("ddp_compiled", "ddp_eager"),
             ("ddp_compiled", "ddp_compiled_plain")]
    return [line(a, b) for a, b in pairs if a in tps and b in tps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,gpt-125m")
    harness.add_rounds(parser, 3)
    parser.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step (tiny.yaml's)")
    parser.add_argument("--micro-batch-125m", type=int, default=1, help="sequences per rank per step at gpt-125m")
    parser.add_argument("--seq-125m", type=int, default=64, help="window length at the gpt-125m shape")
    parser.add_argument("--only", default="", help=f"contenders to run together, of {','.join(CONTENDERS)}")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        for group in run_shape(shape, args):
            for line in lines(shape, group):
                harness.emit(line)


if __name__ == "__main__":
    main()
