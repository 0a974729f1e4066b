"""Claim: the ZeRO-2 engine hides its collectives behind compute. On dp=2 over a rate-limited
link its step with overlap takes <= 0.8x its step without, and <= 1.0x torch DDP's on the same
model and batch, while each rank holds ~1/dp of DDP's optimizer memory.

The two ranks run on a rate-limited veth link between network namespaces, then unlimited
(mshpc.bench.links); without root or iproute2, on loopback.

    .venv/bin/python benchmarks/dp_overlap.py [--rate-mbit 1000] [--micro-batch 4]
        [--bucket-mb 1] [--rounds 6] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S
from mshpc.bench.links import add_link_options, main_on_links, time_steps

# ---------------------------------------------------------------- one rank


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.config import load_config

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.worker,
                            world_size=2, timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    cfg = load_config(REPO / "configs/tiny.yaml")
    steps, facts = build_steps(cfg.model, cfg.optim, args.bucket_mb, args.micro_batch, args.worker)
    times = time_steps(steps, args.rounds, args.steps)
    out = {"step_s": times, "reduce_scatter_s": time_reduce_scatter(args.bucket_mb), **facts()}
    if args.worker == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def build_steps(model_cfg, optim_cfg, bucket_mb: float, micro_batch: int, rank: int) -> tuple[dict, Callable[[], dict]]:
    """A train step for each contender on identical models: (step, finish) pairs, where finish
    lands whatever communication the last step left in flight; and the facts of the run."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from mshpc.config import ParallelConfig
    from mshpc.model.gpt import GPT, loss_fn
    from mshpc.optim.optimizer import build_optimizer
    from mshpc.parallel.zero_build import build_zero_engine

    def fresh() -> GPT:
        torch.manual_seed(0)
        return GPT(model_cfg)

    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, model_cfg.vocab_size, (micro_batch, model_cfg.seq_len + 1), generator=gen)
    x, y = batch[:, :-1], batch[:, 1:]
    # the two ranks share this host's /dev/shm whatever namespaces their links are in: the
    # buckets stay private so that the collectives cross the emulated link
    engines = {o: build_zero_engine(fresh(), optim_cfg, ParallelConfig(dp=2, dp_overlap=o, bucket_mb=bucket_mb,
                                                                        dp_shared_memory=False))
               for o in (True, False)}
    ddp = DistributedDataParallel(fresh(), bucket_cap_mb=bucket_mb)
    ddp_opt = build_optimizer(ddp.module, optim_cfg)
    plain = fresh()
    plain_opt = build_optimizer(plain, optim_cfg)

    def engine_step(overlap: bool) -> Callable[[], None]:
        def step() -> None:
            engine = engines[overlap]
            engine.backward(loss_fn(engine.model(x), y))
            engine.step(optim_cfg.grad_clip)
        return step

    def replicated_step(model: torch.nn.Module, opt: torch.optim.Optimizer, params: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            loss_fn(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(params.parameters(), optim_cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def facts() -> dict:
        ddp_state = [v for s in ddp_opt.state.values() for v in s.values()] + list(ddp.module.parameters())
        return {"engine_optimizer_bytes": engines[True].optimizer_state_bytes(),
                "ddp_optimizer_bytes": sum(t.numel() * t.element_size() for t in ddp_state),
                "params": sum(p.numel() for p in plain.parameters()),
                "tokens_per_rank_step": micro_batch * model_cfg.seq_len,
                "buckets": len(engines[True].buckets)}

    return {
        "overlap": (engine_step(True), engines[True].wait_params),
        "no_overlap": (engine_step(False), engines[False].wait_params),
        "ddp": (replicated_step(ddp, ddp_opt, ddp.module), lambda: None),
        "compute_only": (replicated_step(plain, plain_opt, plain), lambda: None),  # no communication
    }, facts


def time_reduce_scatter(bucket_mb: float, mib: int = 16, repeats: int = 5) -> dict[str, float]:
    """Gloo's reduce-scatter as the engine does it (comm.reduce_scatter: point-to-point sends and a
    local sum) against gloo's own reduce_scatter_single: `mib` MiB as async bucket_mb buckets."""
    import torch
    import torch.distributed as dist

    from mshpc.parallel import comm

    native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    data = torch.randn(mib * 2**18)
    out = torch.empty(data.numel() // 2)
    buckets = max(1, round(mib / bucket_mb))
    pieces = list(zip(out.chunk(buckets), data.chunk(buckets), strict=True))

    def run(fn: Callable) -> float:
        times = []
        for _ in range(repeats):
            comm.barrier()
            start = time.perf_counter()
            for work in [fn(o, i, async_op=True) for o, i in pieces]:
                work.wait()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    # the baseline is measured raw, not through comm: it is the torch call comm avoids on gloo
    return {"engine": run(comm.reduce_scatter), "reduce_scatter_single": run(native)}


# ---------------------------------------------------------------- report


def lines(label: str, r: dict, args: argparse.Namespace) -> list[dict]:
    t, rs = r["step_s"], r["reduce_scatter_s"]
    context = {"link": label, "model": "configs/tiny.yaml", "params": r["params"], "dp": 2,
               "tokens_per_rank_step": r["tokens_per_rank_step"], "bucket_mb": args.bucket_mb,
               "buckets": r["buckets"], "compute_only_s": round(t["compute_only"], 4)}

    def line(metric: str, value: float, baseline: float, unit: str = "s") -> dict:
        return harness.record("dp_overlap", f"{metric}_{label}", value, unit, baseline, **context)

    return [line("step_time_overlap_vs_no_overlap", t["overlap"], t["no_overlap"]),
            line("step_time_overlap_vs_torch_ddp", t["overlap"], t["ddp"]),
            line("gloo_reduce_scatter_p2p_vs_reduce_scatter_single", rs["engine"], rs["reduce_scatter_single"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    # 1 MiB: 12 buckets for this model, and at dp=2 each all-gather is one gloo message (no staging)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="for the engine and for DDP")
    harness.add_rounds(parser, 6)
    parser.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    add_link_options(parser)
    args = parser.parse_args()
    results = main_on_links(__file__, "dp", args, worker, lines)
    if results is None:
        return  # a worker
    r = next(iter(results.values()))
    harness.emit(harness.record("dp_overlap", "optimizer_bytes_per_rank_vs_torch_ddp", r["engine_optimizer_bytes"],
                                "bytes", r["ddp_optimizer_bytes"], dp=2))


if __name__ == "__main__":
    main()
