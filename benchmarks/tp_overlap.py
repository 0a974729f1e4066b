"""Claim: with `parallel.tp_overlap`, the sequence-parallel all-gathers and reduce-scatters are
split into chunks that travel while the neighbouring chunk's GEMM runs, so a tp=2 train step over
a rate-limited link takes less time than the same step with each collective whole (MegaScale
sec. 3.2). Same model, same batch, same numbers out (tests/dist/parallel: bitwise).

Claim (issue #21): the fused parallel block (`parallel.tp_fused_block`, one all-gather and one
reduce-scatter per layer forward) moves about half the tensor-parallel bytes of the unfused one
(Megatron's two of each) and takes less time per step; both with 2 overlap chunks. Bytes are
the sizes of the tp collectives one step enters, from the flight recorder.

Two tp ranks on a rate-limited veth link between network namespaces, then unlimited
(two_ranks.py); without root or iproute2, on loopback. Each step is forward, backward and the
ZeRO optimizer step of configs/tiny.yaml's model split over tp=2 (dp=1); the contenders take
turns within each round, median over rounds.

    .venv/bin/python benchmarks/tp_overlap.py [--rate-mbit 1000] [--micro-batch 4] [--seq-len 256]
        [--chunks 2 4] [--rounds 5] [--steps 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from datetime import timedelta

from two_ranks import REPO, WORKER_TIMEOUT_S, add_link_options, main_on_links, time_steps


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.mesh_shape import MeshShape
    from mshpc.parallel.mesh import build_mesh

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.worker,
                            world_size=2, timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    mesh = build_mesh(MeshShape(pp=1, dp=1, tp=2))
    steps = build_steps(args, mesh)
    wire = {name: tp_bytes_per_step(steps[name][0]) for name in steps if name != "facts"}
    out = {"step_s": time_steps(steps, args.rounds, args.steps), "tp_bytes": wire, **steps["facts"]()}
    if args.worker == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def build_steps(args: argparse.Namespace, mesh) -> dict:
    """A train step per contender: whole collectives, and chunked ones for each --chunks."""
    import torch

    from mshpc.config import load_config
    from mshpc.model.gpt import GPT
    from mshpc.parallel.apply import parallelize

    base = load_config(REPO / "configs/tiny.yaml", [f"model.seq_len={args.seq_len}"])
    batch = torch.randint(0, base.model.vocab_size, (args.micro_batch, args.seq_len + 1),
                          generator=torch.Generator().manual_seed(0))  # the same on both tp ranks
    contenders = {"no_overlap": (False, 1, True), **{f"overlap_{c}_chunks": (True, c, True) for c in sorted({2, *args.chunks})},
                  "unfused_block_overlap_2_chunks": (True, 2, False)}
    steps: dict = {}
    for name, (overlap, chunks, fused) in contenders.items():
        parallel = dataclasses.replace(base.parallel, dp=1, tp=2, tp_overlap=overlap, tp_overlap_chunks=chunks,
                                       tp_fused_block=fused)
        torch.manual_seed(0)
        split = parallelize(GPT(base.model), mesh, dataclasses.replace(base, parallel=parallel))
        steps[name] = (train_step(split, batch, base.optim.grad_clip), split.engine.wait_params)
    params = sum(p.numel() for p in GPT(base.model).parameters())
    steps["facts"] = lambda: {"params": params, "tokens_per_step": args.micro_batch * args.seq_len,
                              "seq_len": args.seq_len, "d_model": base.model.d_model, "n_layer": base.model.n_layer}
    return steps


def tp_bytes_per_step(step: Callable[[], None]) -> int:
    """Bytes of the tp group's all-gathers and reduce-scatters one step enters (a deep recorder
    for the count, so the ring buffer cannot drop any)."""
    import torch.distributed as dist

    from mshpc.parallel import comm

    kept, comm.RECORDER = comm.RECORDER, comm.FlightRecorder(depth=1 << 20)
    try:
        step()
        records = comm.RECORDER.snapshot()
    finally:
        comm.RECORDER = kept
    tp = repr(list(range(dist.get_world_size())))
    return sum(r.nbytes for r in records if r.group == tp and r.op in ("all_gather", "reduce_scatter"))


def train_step(split, batch, grad_clip: float) -> Callable[[], None]:
    def step() -> None:
        split.engine.backward(split.loss_fn(split.engine.model(batch[:, :-1]), batch[:, 1:]))
        split.engine.step(grad_clip)
    return step


def lines(label: str, r: dict, args: argparse.Namespace) -> list[dict]:
    t = r["step_s"]
    context = {"link": label, "model": "configs/tiny.yaml", "tp": 2, "micro_batch": args.micro_batch,
               **{k: r[k] for k in ("params", "tokens_per_step", "seq_len", "d_model", "n_layer")}}
    return [{"bench": "tp_overlap", "metric": f"step_time_overlap_{c}_chunks_vs_no_overlap_{label}",
             "value": round(t[f"overlap_{c}_chunks"], 4), "unit": "s", "baseline": round(t["no_overlap"], 4),
             "ratio": round(t[f"overlap_{c}_chunks"] / t["no_overlap"], 3), "chunks": c, **context}
            for c in args.chunks] + fused_lines(label, r, context)


def fused_lines(label: str, r: dict, context: dict) -> list[dict]:
    """The fused parallel block against the unfused one, both overlapped in 2 chunks."""
    t, wire = r["step_s"], r["tp_bytes"]
    fused, unfused = "overlap_2_chunks", "unfused_block_overlap_2_chunks"
    return [{"bench": "tp_overlap", "metric": f"step_time_fused_block_vs_unfused_block_{label}",
             "value": round(t[fused], 4), "unit": "s", "baseline": round(t[unfused], 4),
             "ratio": round(t[fused] / t[unfused], 3), **context},
            {"bench": "tp_overlap", "metric": f"tp_bytes_per_step_fused_block_vs_unfused_block_{label}",
             "value": wire[fused], "unit": "B", "baseline": wire[unfused],
             "ratio": round(wire[fused] / wire[unfused], 3), **context}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per step (both tp ranks)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    add_link_options(parser)
    args = parser.parse_args()
    main_on_links(__file__, "tp", args, worker, lines)


if __name__ == "__main__":
    main()
