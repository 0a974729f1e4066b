"""Claim (issue #21): the ZeRO engine's gradient path, the step's first gradient copied into its
fp32 bucket view and later ones added (parallel/zero.py `_on_grad`), costs less than the path it
replaced: .grad as the bucket view, autograd adding into it, every bucket zeroed per step.

Both engines compiled (train.compile), on identical models and batches, 2 CPU ranks, taking turns
step by step in one run; the baseline is the current engine with the old two methods put back
(below), so nothing else differs. CPU seconds of rank 0's process per step (gloo's threads
included) beside wall seconds, medians after two warm-up steps.

    .venv/bin/python benchmarks/grad_buckets.py [--shape tiny] [--micro-batch 8] [--steps 10]
        [--seq-len 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S


def zeroed_on_grad(self, index: int) -> None:
    """The replaced hook: .grad is the bucket view, so autograd has already added into it."""
    p, view = self.params[index], self.grad_views[index]
    if p.grad is not view:
        view.add_(p.grad)
        p.grad = view if p.dtype == view.dtype else None
    if self._sync and self.overlap:
        self._ready[self.bucket_of[index]] += 1
        self._launch_reduces(force=False)


def zeroed_next_step(self) -> None:
    """The replaced end of step: every bucket zeroed for the next step's additions."""
    for bucket in self.buckets:
        bucket.grads.zero_()
    self._ready = [0] * len(self.buckets)
    self._next_reduce = 0
    self._reducing = []


def worker(rank: int, port: int, args: argparse.Namespace, out) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.config import load_config
    from mshpc.mesh_shape import MeshShape
    from mshpc.model.gpt import GPT, loss_fn
    from mshpc.parallel.apply import parallelize
    from mshpc.parallel.mesh import build_mesh

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    overrides = ["parallel.dp=2", "train.compile=true"] + ([f"model.seq_len={args.seq_len}"] if args.seq_len else [])
    cfg = load_config(REPO / f"configs/{args.shape}.yaml", overrides)
    mesh = build_mesh(MeshShape(pp=1, dp=2, tp=1))
    batch = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, cfg.model.seq_len + 1),
                          generator=torch.Generator().manual_seed(rank))
    x, y = batch[:, :-1], batch[:, 1:]
    engines = {}
    for name in ("first_copy", "zeroed"):
        torch.manual_seed(0)
        engine = parallelize(GPT(cfg.model), mesh, model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train,
                             optim=cfg.optim).engine
        if name == "zeroed":
            engine._on_grad = types.MethodType(zeroed_on_grad, engine)
            engine._next_step = types.MethodType(zeroed_next_step, engine)
            for p, view in zip(engine.params, engine.grad_views, strict=True):
                p.grad = view
        engines[name] = engine
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    wall: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(args.steps + 2):  # two warm-up steps compile
        for name, engine in engines.items():
            dist.barrier()
            start_cpu, start = time.process_time(), time.perf_counter()
            engine.backward(loss_fn(engine.model(x), y))
            engine.step(cfg.optim.grad_clip)
            engine.wait_params()
            if i >= 2:
                cpu[name].append(time.process_time() - start_cpu)
                wall[name].append(time.perf_counter() - start)
    if rank == 0:
        c = {name: statistics.median(v) for name, v in cpu.items()}
        w = {name: statistics.median(v) for name, v in wall.items()}
        out.put(json.dumps([harness.record(
            "grad_buckets", "cpu_s_per_step_first_copy_vs_zeroed_buckets", c["first_copy"], "s", c["zeroed"],
            wall_ratio=round(w["first_copy"] / w["zeroed"], 3), shape=args.shape,
            micro_batch_per_rank=args.micro_batch, seq_len=cfg.model.seq_len, dp=2, steps=args.steps)]))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine")
    parser.add_argument("--seq-len", type=int, default=0, help="window length (0: the shape's own)")
    args = parser.parse_args()
    for line in harness.run_local_ranks(worker, 2, (args,)):
        harness.emit(line)


if __name__ == "__main__":
    main()
