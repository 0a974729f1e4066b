"""Claim: with `parallel.tp_overlap`, the sequence-parallel all-gathers and reduce-scatters are
split into chunks that travel while the neighbouring chunk's GEMM runs, so a tp=2 train step over
a rate-limited link takes less time than the same step with each collective whole (MegaScale
sec. 3.2). Same model, same batch, same numbers out (tests/dist/parallel: bitwise).

Claim (issue #21): the fused parallel block (`parallel.tp_fused_block`, one all-gather and one
reduce-scatter per layer forward) puts at most 0.55x the tensor-parallel bytes of the unfused
one (Megatron's two of each) on the wire per step, and takes at most 0.9x its time; both with 2
overlap chunks. Bytes: every collective of the tp group one step enters, from the flight
recorder, as what this rank sends ((tp-1)/tp of an all-gather's output or a reduce-scatter's
input, 2(tp-1)/tp of an all-reduce's buffer, an uneven all-to-all's own count).

Two tp ranks on a rate-limited veth link between network namespaces, then unlimited
(mshpc.bench.links); without root or iproute2, on loopback. Before the ranks start, a raw TCP send
of 32 MiB measures what each link carries (the `tc` limit must show). Each step is forward,
backward and the ZeRO optimizer step of configs/tiny.yaml's model split over tp=2 (dp=1); the
contenders take turns within each round (reversed every other round); each prints its median,
min and max over rounds, and the ratio is also given per round (paired, so a neighbour's load
that hits one round hits both). The 1-minute load average before and after each link is
printed beside the figures: on a shared machine, read them with it.

    .venv/bin/python benchmarks/tp_overlap.py [--rate-mbit 1000] [--micro-batch 4] [--seq-len 256]
        [--chunks 2] [--rounds 9] [--steps 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S, time_rounds
from mshpc.bench.links import add_link_options, main_on_links, measure_link_mbit

FUSED, UNFUSED = "overlap_2_chunks", "unfused_block_overlap_2_chunks"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.mesh_shape import MeshShape
    from mshpc.parallel.mesh import build_mesh

    load_before = os.getloadavg()[0]
    link_mbit = measure_link_mbit(args.worker, args.addr, args.port + 1)  # before gloo uses the link
    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.worker,
                            world_size=2, timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    mesh = build_mesh(MeshShape(pp=1, dp=1, tp=2))
    steps, facts = build_steps(args, mesh)
    wire = {name: tp_wire_bytes(steps[name][0]) for name in steps}
    out = {"step_s": time_rounds(steps, args.rounds, args.steps), "tp_wire": wire, "link_mbit": link_mbit,
           "load_avg_1min": [load_before, os.getloadavg()[0]], **facts}
    if args.worker == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def build_steps(args: argparse.Namespace, mesh) -> tuple[dict, dict]:
    """A train step per contender: whole collectives, chunked ones for each --chunks, and the
    unfused block chunked in 2; and the facts of the run."""
    import torch

    from mshpc.config import load_config
    from mshpc.model.gpt import GPT
    from mshpc.parallel.apply import parallelize

    base = load_config(REPO / "configs/tiny.yaml", [f"model.seq_len={args.seq_len}"])
    batch = torch.randint(0, base.model.vocab_size, (args.micro_batch, args.seq_len + 1),
                          generator=torch.Generator().manual_seed(0))  # the same on both tp ranks
    contenders = {"no_overlap": (False, 1, True), **{f"overlap_{c}_chunks": (True, c, True) for c in sorted({2, *args.chunks})},
                  UNFUSED: (True, 2, False)}
    steps: dict = {}
    for name, (overlap, chunks, fused) in contenders.items():
        parallel = dataclasses.replace(base.parallel, dp=1, tp=2, tp_overlap=overlap, tp_overlap_chunks=chunks,
                                       tp_fused_block=fused)
        torch.manual_seed(0)
        split = parallelize(GPT(base.model), mesh, model_cfg=base.model, parallel=parallel, train=base.train,
                            optim=base.optim)
        steps[name] = (train_step(split, batch, base.optim.grad_clip), split.engine.wait_params)
    params = sum(p.numel() for p in GPT(base.model).parameters())
    facts = {"params": params, "tokens_per_step": args.micro_batch * args.seq_len,
             "seq_len": args.seq_len, "d_model": base.model.d_model, "n_layer": base.model.n_layer}
    return steps, facts


# What one rank sends for a collective of `nbytes` (its record's size) over tp ranks: a ring's
# share (all_gather: the output; reduce_scatter: the input; all_reduce: both phases), or the
# uneven all-to-all's own count, which leaves out the rows a rank keeps.
WIRE_SHARE = {"all_gather": lambda n, tp: n * (tp - 1) // tp, "reduce_scatter": lambda n, tp: n * (tp - 1) // tp,
              "all_reduce": lambda n, tp: 2 * n * (tp - 1) // tp, "all_to_all_v": lambda n, tp: n}


def tp_wire_bytes(step: Callable[[], None]) -> dict[str, int]:
    """Bytes this rank sends per op over the tp group in one step (a deep recorder for the
    count, so the ring buffer cannot drop any). Fails on an op it cannot size."""
    import torch.distributed as dist

    from mshpc.parallel import comm

    kept, comm.RECORDER = comm.RECORDER, comm.FlightRecorder(depth=1 << 20)
    try:
        step()
        records = comm.RECORDER.snapshot()
    finally:
        comm.RECORDER = kept
    tp = dist.get_world_size()
    out: dict[str, int] = {}
    for r in records:
        if r.group == repr(list(range(tp))) and r.op != "barrier":
            out[r.op] = out.get(r.op, 0) + WIRE_SHARE[r.op](r.nbytes, tp)
    return out


def train_step(split, batch, grad_clip: float) -> Callable[[], None]:
    def step() -> None:
        split.engine.backward(split.loss_fn(split.engine.model(batch[:, :-1]), batch[:, 1:]))
        split.engine.step(grad_clip)
    return step


def compare(ours: list[float], base: list[float]) -> dict:
    """Medians, ranges, the per-round (paired) ratio and its interval of two contenders' samples."""
    return {**harness.paired(ours, base), "range_s": [round(min(ours), 4), round(max(ours), 4)],
            "baseline_range_s": [round(min(base), 4), round(max(base), 4)]}


def lines(label: str, r: dict, args: argparse.Namespace) -> list[dict]:
    t = r["step_s"]
    context = {"link": label, "link_measured_mbit": r["link_mbit"] and round(r["link_mbit"], 1),
               "load_avg_1min": [round(x, 1) for x in r["load_avg_1min"]], "model": "configs/tiny.yaml", "tp": 2,
               "micro_batch": args.micro_batch,
               **{k: r[k] for k in ("params", "tokens_per_step", "seq_len", "d_model", "n_layer")}}
    link = {"bench": "tp_overlap", "metric": f"link_raw_tcp_send_mbit_vs_configured_{label}",
            "value": context["link_measured_mbit"], "unit": "Mbit/s",
            "baseline": args.rate_mbit if label.endswith("mbit") else None}
    chunked = [{"bench": "tp_overlap", "metric": f"step_time_overlap_{c}_chunks_vs_no_overlap_{label}", "unit": "s",
                **compare(t[f"overlap_{c}_chunks"], t["no_overlap"]), "chunks": c, **context} for c in args.chunks]
    return [link, *chunked, *fused_lines(label, r, context)]


def fused_lines(label: str, r: dict, context: dict) -> list[dict]:
    """The fused parallel block against the unfused one, both overlapped in 2 chunks."""
    wire = r["tp_wire"]
    fused, unfused = sum(wire[FUSED].values()), sum(wire[UNFUSED].values())
    return [{"bench": "tp_overlap", "metric": f"step_time_fused_block_vs_unfused_block_{label}", "unit": "s",
             **compare(r["step_s"][FUSED], r["step_s"][UNFUSED]), "target_ratio": 0.9, **context},
            {"bench": "tp_overlap", "metric": f"tp_wire_bytes_per_step_fused_block_vs_unfused_block_{label}",
             "value": fused, "unit": "B", "baseline": unfused, "ratio": round(fused / unfused, 4),
             "target_ratio": 0.55, "by_op": wire[FUSED], "baseline_by_op": wire[UNFUSED], **context}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per step (both tp ranks)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2],
                        help="chunk counts to time against no overlap (2 is always built: the fused block's)")
    harness.add_rounds(parser, 9)
    parser.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    add_link_options(parser)
    args = parser.parse_args()
    main_on_links(__file__, "tp", args, worker, lines)


if __name__ == "__main__":
    main()
