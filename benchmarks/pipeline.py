"""Claim: with decoupled sends and receives, 1F1B and interleaved 1F1B idle about as much as the
papers compute, (p - 1) / (m + p - 1) and (p - 1) / (v m + p - 1), so interleaving cuts the
bubble and the step time against 1F1B, which matches GPipe's bubble with less activation memory.

pp=2 ranks in two network namespaces joined by a rate-limited veth pair, then once more
unlimited (mshpc.bench.links); loopback without root. The three
schedules train the same model on the same batches, taking turns in every round. Measured
bubble: the time a stage idles in the forward-backward part of the step (blocked in receives
and send-waits, then waiting for the slowest stage to finish) over that part's time, averaged
over the stages; `wait_of_step` is the blocked time alone over the whole step.

    .venv/bin/python benchmarks/pipeline.py [--rate-mbit 1000] [--micro-batch 2]
        [--micro-batches 8] [--rounds 5] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S
from mshpc.bench.links import add_link_options, main_on_links

SCHEDULES = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved": ("1f1b", 2)}  # name: (schedule, v)


# ---------------------------------------------------------------- one rank


def build(args: argparse.Namespace) -> dict:
    """One pipeline per contender, on identical models; returns name -> Pipeline."""
    import dataclasses

    import torch

    from mshpc.config import load_config
    from mshpc.mesh_shape import MeshShape
    from mshpc.parallel.mesh import build_mesh
    from mshpc.parallel.pipeline import build_pipeline

    base = load_config(REPO / "configs/tiny.yaml")
    pipes = {}
    for name, (schedule, v) in SCHEDULES.items():
        cfg = dataclasses.replace(
            base, parallel=dataclasses.replace(base.parallel, dp=1, pp=2, virtual_stages=v, pp_schedule=schedule),
            train=dataclasses.replace(base.train, micro_batch=args.micro_batch, grad_accum=args.micro_batches))
        torch.manual_seed(0)
        mesh = build_mesh(MeshShape(pp=2, dp=1, tp=1))
        pipes[name] = (cfg, build_pipeline(mesh, torch.device("cpu"), None, model_cfg=cfg.model,
                                                   parallel=cfg.parallel, train=cfg.train, optim=cfg.optim))
    return pipes


def time_schedules(pipes: dict, batch, rounds: int, per_round: int) -> dict[str, dict[str, float]]:
    """Median over rounds (round 0 is warm-up) of the per-step step time, forward-backward time
    and wait time. The contenders take turns within each round, so a noisy neighbour on the
    machine slows them alike."""
    from mshpc.parallel import comm
    from mshpc.parallel.pipeline import pipeline_train_step

    samples: dict[str, dict[str, list[float]]] = {n: {"step_s": [], "run_s": [], "wait_s": []} for n in pipes}
    for r in range(rounds + 1):
        for name, (cfg, pipe) in pipes.items():
            comm.barrier()
            runner = pipe.runner
            waited, ran, start = runner.wait_s, runner.run_s, time.perf_counter()
            for _ in range(per_round):
                pipeline_train_step(pipe, batch, train=cfg.train, optim=cfg.optim, parallel=cfg.parallel)
            pipe.engine.wait_params()
            if r > 0:
                s = samples[name]
                s["step_s"].append((time.perf_counter() - start) / per_round)
                s["run_s"].append((runner.run_s - ran) / per_round)
                s["wait_s"].append((runner.wait_s - waited) / per_round)
    out = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    for name, (_, pipe) in pipes.items():
        out[name]["peak_live"] = pipe.runner.peak_live  # micro-batch activations held at once
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.batch import Batch
    from mshpc.parallel import comm

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.worker,
                            world_size=2, timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    pipes = build(args)
    cfg = next(iter(pipes.values()))[0]
    batch = Batch(torch.randint(0, cfg.model.vocab_size, (args.micro_batch * args.micro_batches, cfg.model.seq_len + 1),
                                generator=torch.Generator().manual_seed(0)))
    mine = time_schedules(pipes, batch, args.rounds, args.steps)
    stages = comm.all_gather_json(mine)  # each stage's own waits
    if args.worker == 0:
        act_bytes = args.micro_batch * cfg.model.seq_len * cfg.model.d_model * 4
        print(json.dumps({"stages": stages, "act_bytes": act_bytes, "model": cfg.model.n_layer}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- report


def lines(label: str, r: dict, args: argparse.Namespace) -> list[dict]:
    from mshpc.parallel.schedules import PipeShape, bubble_fraction

    out = []
    base = statistics.mean(s["gpipe"]["step_s"] for s in r["stages"])
    for name, (_, v) in SCHEDULES.items():
        per_stage = [s[name] for s in r["stages"]]
        step_s = statistics.mean(s["step_s"] for s in per_stage)
        # A stage idles while blocked in the pipeline and, once done, until the slowest is done.
        span = max(s["run_s"] for s in per_stage)
        idle = [s["wait_s"] + span - s["run_s"] for s in per_stage]
        theory = bubble_fraction(PipeShape(2, v, args.micro_batches))
        out.append(harness.record(
            "pipeline", f"step_time_{name}_vs_gpipe_{label}", step_s, "s", base,
            bubble_measured=round(statistics.mean(idle) / span, 3), bubble_theory=round(theory, 3),
            wait_of_step=round(statistics.mean(s["wait_s"] for s in per_stage) / step_s, 3),
            forward_backward_s=round(span, 4), idle_s_per_stage=[round(i, 4) for i in idle],
            peak_live_per_stage=[s["peak_live"] for s in per_stage], pp=2, virtual_stages=v,
            micro_batches=args.micro_batches, micro_batch=args.micro_batch, act_bytes=r["act_bytes"],
            link=label, model="configs/tiny.yaml"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (m)")
    harness.add_rounds(parser, 5)
    parser.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    add_link_options(parser)
    args = parser.parse_args()
    main_on_links(__file__, "pp", args, worker, lines)


if __name__ == "__main__":
    main()
