"""Claim (issue #36): configs/tiny-moe.yaml trains at >= 1.3x the tokens/s of a plain PyTorch DDP
loop of the same model whose MoE layers are transformers' own MixtralSparseMoeBlock (the eager
experts path: a Python loop over the experts, each gathering its tokens and index_add-ing its
output back), both eager and both compiled, on 2 CPU ranks, side by side in one run.

Four contenders on identical weights (the baseline's router and experts copied from mshpc's:
transformers' MixtralExperts has mshpc's [gate; up] layout) and batches, taking turns within
each round (mshpc.bench.harness.time_rounds): mshpc eager and compiled (ZeRO-2, fused kernels,
grouped experts, the fused permute/unpermute, the router's auxiliary loss), DDP eager and
compiled (torch's DistributedDataParallel, torch's AdamW, clip_grad_norm_; the same per-block
torch.compile, graph breaks allowed on both sides: the expert loop's shapes depend on the
routing). Rank 0's CPU seconds per step (gloo's threads included) are reported beside the wall
time, with the load average: on a loaded machine read tokens per CPU-second.

Both sides compute under bf16 autocast by default, the dtype a GPU rank trains in (`train.dtype:
auto`) and the claim's; `--dtype fp32` runs CPU ranks' default instead, where both steps are their
GEMMs at near the core's peak and the claim is out of reach (docs/benchmarks/moe_cpu2_2026-12-07.md).

    .venv/bin/python benchmarks/moe_vs_ddp.py [--rounds 6] [--steps 2] [--micro-batch 8] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import statistics
from collections.abc import Callable
from datetime import timedelta

from compile_vs_ddp import cpu_timed

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S, time_rounds

CONTENDERS = ("mshpc_eager", "mshpc_compiled", "ddp_eager", "ddp_compiled")


def transformers_moe(moe, d_model: int, expert_ffn: int):
    """transformers' MixtralSparseMoeBlock with the weights of mshpc's MoE layer `moe`."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=d_model, intermediate_size=expert_ffn, num_local_experts=moe.moe.n_experts,
                        num_experts_per_tok=moe.moe.top_k, experts_implementation="eager")
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.weight)
        block.experts.gate_up_proj.copy_(moe.experts.fc)
        block.experts.down_proj.copy_(moe.experts.proj)
    return block


def build_steps(cfg, rank: int, micro_batch: int, dtype: str) -> dict:
    import torch

    from mshpc.bench.ddp_baseline import ddp_train_step
    from mshpc.mesh_shape import MeshShape
    from mshpc.model.gpt import GPT, loss_fn
    from mshpc.model.moe import MoE
    from mshpc.parallel.apply import parallelize
    from mshpc.parallel.compile_blocks import apply_compile
    from mshpc.parallel.mesh import build_mesh

    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len + 1), generator=gen)
    x, y = batch[:, :-1], batch[:, 1:]
    mesh = build_mesh(MeshShape(pp=1, dp=2, tp=1))
    autocast = {"fp32": None, "bf16": torch.bfloat16}[dtype]

    def fresh() -> GPT:
        torch.manual_seed(0)
        return GPT(cfg.model)

    def mshpc_step(compiled: bool) -> tuple[Callable[[], None], Callable[[], None]]:
        train = dataclasses.replace(cfg.train, compile=compiled)
        engine = parallelize(fresh(), mesh, model_cfg=cfg.model, parallel=cfg.parallel, train=train,
                             optim=cfg.optim).engine

        def step() -> None:
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):  # as train.py does
                loss = loss_fn(engine.model(x), y)
            engine.backward(loss)
            engine.step(cfg.optim.grad_clip)
        return step, engine.wait_params

    def ddp_step(compiled: bool) -> tuple[Callable[[], None], Callable[[], None]]:
        model = fresh()
        for block in model.layers.values():
            if isinstance(block.mlp, MoE):
                block.mlp = transformers_moe(block.mlp, cfg.model.d_model, cfg.model.expert_ffn)
        if compiled:
            apply_compile(model.layers.values(), cfg.model.fused_kernels, torch.device("cpu"), fullgraph=False)
        return ddp_train_step(model, x, y, parallel=cfg.parallel, optim=cfg.optim, autocast=autocast)

    build = {"mshpc_eager": lambda: mshpc_step(False), "mshpc_compiled": lambda: mshpc_step(True),
             "ddp_eager": lambda: ddp_step(False), "ddp_compiled": lambda: ddp_step(True)}
    return {name: build[name]() for name in CONTENDERS}


def worker(rank: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.config import load_config

    torch.set_num_threads(1)  # two ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    cfg = load_config(REPO / "configs/tiny-moe.yaml", ["parallel.dp=2"])
    steps = build_steps(cfg, rank, args.micro_batch, args.dtype)
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    faults: dict[str, list[int]] = {name: [] for name in steps}
    steps = {name: (cpu_timed(step, cpu[name], faults[name]), finish) for name, (step, finish) in steps.items()}
    times = time_rounds(steps, args.rounds, args.steps)
    warm_up = 1 + args.steps
    if rank == 0:
        out.put(json.dumps({"round_s": times, "cpu_s": {n: statistics.median(s[warm_up:]) for n, s in cpu.items()},
                            "tokens_per_step": 2 * args.micro_batch * cfg.model.seq_len}))
    dist.destroy_process_group()


def lines(r: dict, load: list[float], args: argparse.Namespace) -> list[dict]:
    tokens = r["tokens_per_step"]
    per_cpu = {n: tokens / s for n, s in r["cpu_s"].items()}
    context = {"config": "configs/tiny-moe.yaml", "dp": 2, "device": "cpu", "dtype": args.dtype,
               "micro_batch_per_rank": args.micro_batch, "load_avg": load,
               "baseline_moe": "transformers MixtralSparseMoeBlock, eager experts loop"}
    out = []
    for ours, base in (("mshpc_eager", "ddp_eager"), ("mshpc_compiled", "ddp_compiled")):
        # tokens/s ratio = baseline step time / ours, so the interval is of base / ours
        lo, hi = harness.paired_round_interval([[s] for s in r["round_s"][base]], [[s] for s in r["round_s"][ours]])
        ours_tps, base_tps = (tokens / statistics.median(r["round_s"][n]) for n in (ours, base))
        out.append(harness.record("moe_vs_ddp", f"tokens_per_s_{ours}_vs_{base}_transformers_mixtral_block",
                                  ours_tps, "tokens/s", base_tps, digits=1, ratio_90pct=[round(lo, 4), round(hi, 4)],
                                  target_ratio=1.3, tokens_per_cpu_s=round(per_cpu[ours], 1),
                                  baseline_tokens_per_cpu_s=round(per_cpu[base], 1),
                                  cpu_ratio=round(per_cpu[ours] / per_cpu[base], 4), **context))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_rounds(parser, 6)
    parser.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="bf16 autocast (GPU ranks' default, the claim's) or fp32 (CPU ranks'), on both sides")
    args = parser.parse_args()
    load = harness.load_average()
    r = harness.run_local_ranks(worker, 2, (args,))
    for line in lines(r, [load, harness.load_average()], args):
        harness.emit(line)


if __name__ == "__main__":
    main()
