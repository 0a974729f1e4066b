"""Where a compiled step's CPU goes (issue #21): mshpc compiled (ZeRO-2, blocks compiled) and the
plain compiled DDP loop of benchmarks/compile_vs_ddp.py, one step split into forward, backward,
optimizer step (clip included) and, for mshpc, the wait for the last all-gathers; each phase's
CPU seconds on the calling thread, and the CPU of the process's other threads (gloo's, which
carry the communication), median over steps, rank 0, 2 CPU ranks. CPU time, not wall time, so
that a loaded shared machine moves the figures little; wall seconds ride along.

    .venv/bin/python benchmarks/compile_phases.py [--shape tiny] [--micro-batch 8] [--steps 8] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S

Phases = tuple[Callable[[], object], Callable[[object], None], Callable[[], None], Callable[[], None]]


def contenders(cfg, rank: int, micro_batch: int) -> dict[str, Phases]:
    """(forward, backward, step, wait) of mshpc compiled and of compiled DDP, on one batch."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from mshpc.mesh_shape import MeshShape
    from mshpc.model.gpt import GPT, loss_fn
    from mshpc.optim.optimizer import build_optimizer
    from mshpc.parallel.apply import parallelize
    from mshpc.parallel.compile_blocks import apply_compile
    from mshpc.parallel.mesh import build_mesh

    batch = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len + 1),
                          generator=torch.Generator().manual_seed(rank))
    x, y = batch[:, :-1], batch[:, 1:]
    torch.manual_seed(0)
    compiled = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=True))
    engine = parallelize(GPT(cfg.model), build_mesh(MeshShape(pp=1, dp=2, tp=1)), model_cfg=compiled.model,
                         parallel=compiled.parallel, train=compiled.train, optim=compiled.optim).engine
    torch.manual_seed(0)
    model = GPT(cfg.model)
    apply_compile(model.layers.values(), cfg.model.fused_kernels, torch.device("cpu"), fullgraph=True)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    opt = build_optimizer(model, cfg.optim)

    def ddp_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"mshpc_compiled": (lambda: loss_fn(engine.model(x), y), engine.backward,
                               lambda: engine.step(cfg.optim.grad_clip), engine.wait_params),
            "ddp_compiled": (lambda: loss_fn(ddp(x), y), lambda loss: loss.backward(), ddp_step, lambda: None)}


def timed_step(phases: Phases) -> dict[str, float]:
    forward, backward, step, wait = phases
    marks = [(time.thread_time(), time.perf_counter(), time.process_time())]
    loss = forward()
    marks.append((time.thread_time(), time.perf_counter(), time.process_time()))
    backward(loss)
    marks.append((time.thread_time(), time.perf_counter(), time.process_time()))
    step()
    marks.append((time.thread_time(), time.perf_counter(), time.process_time()))
    wait()
    marks.append((time.thread_time(), time.perf_counter(), time.process_time()))
    out = {f"{name}_cpu_s": marks[i + 1][0] - marks[i][0] for i, name in enumerate(("forward", "backward", "step", "wait"))}
    out["other_threads_cpu_s"] = (marks[-1][2] - marks[0][2]) - (marks[-1][0] - marks[0][0])
    out["process_cpu_s"] = marks[-1][2] - marks[0][2]
    out["wall_s"] = marks[-1][1] - marks[0][1]
    return out


def worker(rank: int, port: int, args: argparse.Namespace, out) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.config import load_config

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    overrides = ["parallel.dp=2"] + ([f"model.seq_len={args.seq_len}"] if args.seq_len else [])
    cfg = load_config(REPO / f"configs/{args.shape}.yaml", overrides)
    built = contenders(cfg, rank, args.micro_batch)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in built}
    for i in range(args.steps + 2):  # the two warm-up steps compile; the contenders take turns
        for name, phases in built.items():
            dist.barrier()
            sample = timed_step(phases)
            if i >= 2:
                samples[name].append(sample)
    if rank == 0:
        lines = []
        for name, rows in samples.items():
            med = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
            lines.append({"bench": "compile_phases", "contender": name, "shape": args.shape,
                          "micro_batch_per_rank": args.micro_batch, "unit": "s", **med})
        out.put(json.dumps(lines))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per contender")
    parser.add_argument("--seq-len", type=int, default=0, help="window length (0: the shape's own)")
    args = parser.parse_args()
    for line in harness.run_local_ranks(worker, 2, (args,)):
        harness.emit(line)


if __name__ == "__main__":
    main()
