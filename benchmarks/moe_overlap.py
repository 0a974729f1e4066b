"""Claim (issue #36, MegaScale-MoE sec. 4): with `parallel.ep_overlap` a micro-batch's tokens go
to their experts in chunks, chunk c + 1 travelling while chunk c's experts compute (both ways:
backward starts each gradient's exchange as soon as it exists), so the all-to-all time left
exposed in a train step is at most 0.6x of that without overlap, on a 1 Gbit/s link. And the
dispatch and combine put on the wire exactly the token rows the routing sends to the other ep
rank: bytes on the wire per step equal the formula within 1%.

Two ranks, ep=2 (each holds 4 of configs/tiny-moe.yaml's 8 experts), on a rate-limited veth link
between network namespaces, then unlimited (mshpc.bench.links); without root, loopback. Each
step is forward, backward and the ZeRO update of the whole model; the contenders (overlap in 2
chunks; none) take turns within each round. Exposed all-to-all: the step's time in the
`comm.all_to_all_v` and `comm.all_to_all` phases (diagnose/timers.py: a blocking call, and an
async one's wait), which is what the flight recorder and `timings/` show in a run.

Bytes: one MoE layer's forward and backward alone (no other collective on the link), `--layer-
steps` times; the wire is the rank's interface counters (/proc/net/dev: tx bytes less 66 bytes of
Ethernet, IPv4 and TCP headers per packet, ACKs included); the formula, from the routing itself:
per step 2 (D + R) d 4 bytes, D the token copies this rank routed to the other rank's experts
and R those it received (dispatch and combine, forward and backward), plus the counts' exchange.
The plan's formula for balanced routing, 4 T k d 4 (ep - 1) / ep per rank and layer
(mshpc/plan/moe_plan.py), is printed beside it with the routing's measured balance.

    .venv/bin/python benchmarks/moe_overlap.py [--rate-mbit 1000] [--micro-batch 8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S, turns
from mshpc.bench.links import add_link_options, main_on_links, measure_link_mbit

HEADER_BYTES = 14 + 20 + 32  # Ethernet, IPv4, TCP with timestamps: per packet on the veth
A2A_PHASES = ("comm.all_to_all_v", "comm.all_to_all")


def interface_tx() -> tuple[int, int]:
    """(tx bytes, tx packets) of this network namespace's interfaces but loopback."""
    total_bytes = total_packets = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            if name.strip() != "lo":
                fields = data.split()
                total_bytes, total_packets = total_bytes + int(fields[8]), total_packets + int(fields[9])
    return total_bytes, total_packets


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.mesh_shape import MeshShape
    from mshpc.parallel.mesh import build_mesh

    load_before = os.getloadavg()[0]
    link_mbit = measure_link_mbit(args.worker, args.addr, args.port + 1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.worker,
                            world_size=2, timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))
    mesh = build_mesh(MeshShape(pp=1, dp=2, tp=1, ep=2))
    models, batch, model_cfg = build(args, mesh)
    out = {"exposed": timed(models, batch, args), "wire": wire_bytes(models["overlap"], model_cfg, args),
           "link_mbit": link_mbit, "load_avg_1min": [load_before, os.getloadavg()[0]]}
    if args.worker == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def build(args: argparse.Namespace, mesh):
    """The contenders: configs/tiny-moe.yaml at ep=2, overlapped in --chunks chunks or not."""
    import torch

    from mshpc.config import load_config
    from mshpc.model.gpt import GPT
    from mshpc.parallel.apply import parallelize

    base = load_config(REPO / "configs/tiny-moe.yaml", [f"model.seq_len={args.seq_len}", "parallel.ep=2"])
    gen = torch.Generator().manual_seed(1 + args.worker)  # each dp rank its own batch
    batch = torch.randint(0, base.model.vocab_size, (args.micro_batch, args.seq_len + 1), generator=gen)
    models = {}
    for name, overlap in (("overlap", True), ("no_overlap", False)):
        parallel = dataclasses.replace(base.parallel, ep_overlap=overlap, ep_overlap_chunks=args.chunks)
        torch.manual_seed(0)
        models[name] = parallelize(GPT(base.model), mesh, model_cfg=base.model, parallel=parallel,
                                   train=base.train, optim=base.optim)
    return models, batch, base.model


def timed(models: dict, batch, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per contender and round: the mean step time and exposed all-to-all time per step."""
    import torch

    from mshpc.diagnose.timers import TIMERS
    from mshpc.parallel import comm

    TIMERS.configure(True, torch.device("cpu"))
    out = {name: {"step_s": [], "all_to_all_s": [], "counts_s": []} for name in models}
    for r, order in enumerate(turns(list(models), args.rounds + 1)):
        for name in order:
            split = models[name]
            comm.barrier()
            step_s = a2a_s = counts_s = 0.0
            for k in range(args.steps):
                TIMERS.begin_step(k)
                split.engine.backward(split.loss_fn(split.engine.model(batch[:, :-1]), batch[:, 1:]))
                split.engine.step(1.0)
                split.engine.wait_params()
                seconds, phases = TIMERS.end_step().resolve()
                step_s += seconds
                a2a_s += sum(phases.get(p, 0.0) for p in A2A_PHASES)
                counts_s += phases.get("comm.all_to_all", 0.0)  # the blocking exchange of the counts
            if r > 0:  # round 0 warms up
                out[name]["step_s"].append(step_s / args.steps)
                out[name]["all_to_all_s"].append(a2a_s / args.steps)
                out[name]["counts_s"].append(counts_s / args.steps)
    TIMERS.configure(False, torch.device("cpu"))
    return out


def wire_bytes(split, model_cfg, args: argparse.Namespace) -> dict[str, float]:
    """Layer 0's MoE forward and backward alone, --layer-steps times: the interface's payload
    bytes against the routing's formula (see the module doc), per step."""
    import torch

    from mshpc.parallel import comm

    moe = split.engine.model.layers["0"].mlp
    e, d = model_cfg.moe.n_experts, model_cfg.d_model
    mine = range(split.engine.rank * e // 2, (split.engine.rank + 1) * e // 2)  # this ep rank's experts
    x = torch.randn(args.micro_batch, args.seq_len, d, generator=torch.Generator().manual_seed(7), requires_grad=True)
    grad = torch.randn(args.micro_batch, args.seq_len, d)
    moe(x).backward(grad)  # warm-up: every pair of ranks connected
    moe.stats.zero_()
    comm.barrier()
    sent_before = interface_tx()
    for _ in range(args.layer_steps):
        moe(x).backward(grad)
    comm.barrier()
    sent_after = interface_tx()
    routed = moe.stats[:e].tolist()
    away = sum(c for i, c in enumerate(routed) if i not in mine)  # D: copies this rank sent to the other
    received = comm.all_gather_json(away)[1 - split.engine.rank]  # R: what the other sent here
    chunks = moe.dispatch.chunks
    counts_bytes = chunks * (e // 2) * 8  # the counts' exchange: this rank's (chunk, expert) int64 to the other
    steps = args.layer_steps
    payload = (sent_after[0] - sent_before[0]) - HEADER_BYTES * (sent_after[1] - sent_before[1])
    tokens = args.micro_batch * args.seq_len * model_cfg.moe.top_k
    return {"wire_payload_bytes": payload / steps, "packets": (sent_after[1] - sent_before[1]) / steps,
            "formula_bytes": (2 * (away + received) * d * 4) / steps + counts_bytes,
            "balanced_formula_bytes": 4 * tokens * d * 4 * (2 - 1) / 2,
            "share_sent_away": away / (tokens * steps), "rows_sent": away / steps, "rows_received": received / steps}


def lines(label: str, r: dict, args: argparse.Namespace) -> list[dict]:
    ex, wire = r["exposed"], r["wire"]
    context = {"link": label, "link_measured_mbit": r["link_mbit"] and round(r["link_mbit"], 1),
               "load_avg_1min": [round(x, 1) for x in r["load_avg_1min"]], "model": "configs/tiny-moe.yaml",
               "ep": 2, "chunks": args.chunks, "micro_batch": args.micro_batch, "seq_len": args.seq_len}
    ours, base = ex["overlap"], ex["no_overlap"]
    return [
        {"bench": "moe_overlap", "metric": f"exposed_all_to_all_s_overlap_vs_no_overlap_{label}", "unit": "s",
         **harness.paired(ours["all_to_all_s"], base["all_to_all_s"]), "target_ratio": 0.6,
         "counts_exchange_s": round(statistics.median(ours["counts_s"]), 4),
         "baseline_counts_exchange_s": round(statistics.median(base["counts_s"]), 4), **context},
        {"bench": "moe_overlap", "metric": f"step_time_overlap_vs_no_overlap_{label}", "unit": "s",
         **harness.paired(ours["step_s"], base["step_s"]), **context},
        harness.record("moe_overlap", f"all_to_all_wire_bytes_per_layer_step_vs_formula_{label}",
                       wire["wire_payload_bytes"], "B", wire["formula_bytes"], digits=1, target_ratio=[0.99, 1.01],
                       balanced_formula_bytes=wire["balanced_formula_bytes"],
                       share_of_copies_sent_away=round(wire["share_sent_away"], 4),
                       packets_per_step=round(wire["packets"], 1), **context),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=2, help="parallel.ep_overlap_chunks of the overlapped one")
    harness.add_rounds(parser, 7)
    parser.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    parser.add_argument("--layer-steps", type=int, default=10, help="MoE-layer steps counted for the bytes")
    add_link_options(parser)
    args = parser.parse_args()
    main_on_links(__file__, "moe", args, worker, lines)


if __name__ == "__main__":
    main()
