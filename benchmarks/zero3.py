"""Claim: ZeRO stage 3 (parallel.zero_stage: 3) hides its extra gathers behind compute. On dp=2 over
a 1 Gbit/s link, gpt-125m, its step takes <= 1.15x stage 2's, and it puts 1.5x stage 2's bytes on
the wire (within 2%): a reduce-scatter and two all-gathers of every weight instead of one of each.

Both stages train side by side in one run on the same model and batch (the harness's turns), in
private buckets (the /dev/shm buckets would carry stage 2's bytes off the link). The two ranks run
on a rate-limited veth link between network namespaces, then unlimited (mshpc.bench.links); the
bytes on the wire are the link's own counter (its interface's tx_bytes) over one step; without
root or iproute2 the ranks run on loopback, whose counter every other process on the host shares.

    .venv/bin/python benchmarks/zero3.py [--rate-mbit 1000] [--seq-len 1024] [--micro-batch 1]
        [--rounds 3] [--steps 1]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S
from mshpc.bench.links import add_link_options, main_on_links

STAGES = ("stage2", "stage3")


def worker(args: argparse.Namespace) -> None:
    import json

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.worker,
                            world_size=2, timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    steps, facts = build_steps(args)
    out = {"step_s": harness.time_rounds(steps, args.rounds, args.steps), **facts()}
    if args.worker == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def build_steps(args: argparse.Namespace) -> tuple[dict, Callable[[], dict]]:
    """A train step for each stage on identical models, (step, finish) pairs; and the facts of the
    run, each stage's bytes per step on the wire and in the flight recorder among them."""
    import dataclasses

    import torch

    from mshpc.config import ParallelConfig, load_config
    from mshpc.model.gpt import GPT, loss_fn
    from mshpc.parallel.zero3 import block_units
    from mshpc.parallel.zero_build import build_zero_engine

    cfg = load_config(REPO / "configs/gpt-125m.yaml")
    model_cfg = dataclasses.replace(cfg.model, seq_len=args.seq_len)
    engines = {}
    for name in STAGES:
        torch.manual_seed(0)
        model = GPT(model_cfg)
        blocks = block_units([(int(i), b) for i, b in model.layers.items()], 1)
        parallel = ParallelConfig(dp=2, zero_stage=3 if name == "stage3" else 2, dp_shared_memory=False)
        engines[name] = build_zero_engine(model, cfg.optim, parallel, blocks=blocks)
    gen = torch.Generator().manual_seed(args.worker)
    batch = torch.randint(0, model_cfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=gen)

    def step_of(name: str) -> Callable[[], None]:
        def step() -> None:
            engine = engines[name]
            engine.backward(loss_fn(engine.model(batch[:, :-1]), batch[:, 1:]))
            engine.step(cfg.optim.grad_clip)
        return step

    def facts() -> dict:
        return {"params": sum(p.numel() for p in engines["stage2"].params),
                "tokens_per_rank_step": args.micro_batch * args.seq_len,
                **{f"{name}_bytes": step_bytes(step_of(name), engines[name].wait_params) for name in STAGES}}

    return {name: (step_of(name), engines[name].wait_params) for name in STAGES}, facts


def step_bytes(step: Callable[[], None], finish: Callable[[], None]) -> dict[str, int]:
    """What one steady step sends: bytes leaving this rank's link (its interface's tx counter,
    headers included) and the bytes of its dp collectives in the flight recorder."""
    from mshpc.parallel import comm

    step()  # the lead-in: its gathers for the next step are in flight, as in training
    finish()
    comm.barrier()
    wire, seq = tx_bytes(), comm.RECORDER.snapshot()[-1].seq
    step()
    finish()
    comm.barrier()
    records = [r for r in comm.RECORDER.snapshot() if r.seq > seq and r.op in ("all_gather", "reduce_scatter")]
    return {"wire": tx_bytes() - wire, "collectives": sum(r.nbytes for r in records)}


def tx_bytes() -> int:
    # the interface gloo was told to use: the rank's veth (mshpc.bench.links), or lo on loopback
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def lines(label: str, r: dict, args: argparse.Namespace) -> list[dict]:
    paired = harness.paired(r["step_s"]["stage3"], r["step_s"]["stage2"])
    context = {"link": label, "model": "configs/gpt-125m.yaml", "params": r["params"], "dp": 2,
               "seq_len": args.seq_len, "tokens_per_rank_step": r["tokens_per_rank_step"],
               "load_average": harness.load_average()}

    def line(metric: str, value: float, baseline: float, unit: str, **more: object) -> dict:
        return harness.record("zero3", f"{metric}_{label}", value, unit, baseline, **context, **more)

    two, three = r["stage2_bytes"], r["stage3_bytes"]
    interval = {k: paired[k] for k in ("ratio_90pct", "ratio_per_round", "rounds")}
    out = [line("step_time_stage3_vs_stage2", paired["value"], paired["baseline"], "s", **interval),
           line("collective_bytes_stage3_vs_stage2", three["collectives"], two["collectives"], "bytes")]
    if label != "loopback":  # loopback's counter is every local process's
        out.append(line("wire_bytes_stage3_vs_stage2", three["wire"], two["wire"], "bytes"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # 1,024 tokens a rank a step (gpt-125m's own: 8 x 2,048): at 256 the lm head's wait for the
    # embedding's gather is a floor of ~1.2x (docs/benchmarks/zero3_cpu2_2026-12-06.md)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (gpt-125m's is 2048)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    harness.add_rounds(parser, 3)  # a step takes 12-15 s at 1,024 tokens: 3 x 1 keeps a run near 10 min
    parser.add_argument("--steps", type=int, default=1, help="steps per stage per round")
    add_link_options(parser)
    main_on_links(__file__, "z3", parser.parse_args(), worker, lines)


if __name__ == "__main__":
    main()
