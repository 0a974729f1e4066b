"""Claim (issue #21): what one block saves for backward, measured (autograd's saved tensors,
each storage once: mshpc/plan/saved_activations.py), equals the plan's per-layer formula
(mshpc/plan/memory.py) and stays within 1.15x of Korthikanti et al. 2022's count for the same
block (16/t elements serial, 14/t parallel, without dropout), at tp = 1, 2 and 4 on gloo ranks.

    .venv/bin/python benchmarks/activation_memory.py [--seq-len 64] [--micro-batch 2] [--tp 1 2 4]

One JSON line per (block, tp, dtype): bytes per s*b*h measured, the formula's, and the ratio of
the measured elements (fp32) to the paper's count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.distributed as dist

from mshpc.bench import harness

PAPER_ELEMENTS = {"serial": 16, "parallel": 14}  # Korthikanti's count without dropout, times t


def rank_main(rank: int, port: int, world: int, args: argparse.Namespace, out) -> None:
    from mshpc.config import ModelConfig
    from mshpc.plan.layout import Layout
    from mshpc.plan.memory import layer_activation_bytes
    from mshpc.plan.saved_activations import layer_bytes, measure

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from mshpc.cpu_ranks.tunings import select_cpu_tunings

    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
    base = ModelConfig(vocab_size=64, seq_len=args.seq_len, n_layer=3, n_head=4, d_model=128, dropout=0.0)
    sbh = args.seq_len * args.micro_batch * base.d_model
    lines = []
    for block in ("serial", "parallel"):
        m = dataclasses.replace(base, parallel_block=block == "parallel")
        for dtype, autocast, elem in (("fp32", None, 4), ("bf16", torch.bfloat16, 2)):
            got = layer_bytes(measure(m, "none", args.micro_batch, dist.group.WORLD, autocast=autocast), m.n_layer)
            layout = Layout(dp=1, tp=world, pp=1, virtual_stages=1, micro_batch=args.micro_batch, n_micro=1,
                            checkpointing="none")
            want = layer_activation_bytes(m, layout, act_bytes=elem)
            line = harness.record("activation_memory", f"saved_bytes_per_sbh_{block}_tp{world}_{dtype}_vs_formula",
                                  got / sbh, "B/sbh", want / sbh, digits=3, tp=world)
            if dtype == "fp32":
                line["elements_vs_korthikanti"] = round(got / 4 / sbh * world / PAPER_ELEMENTS[block], 3)
            lines.append(line)
    if rank == 0:
        out.put(json.dumps(lines))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    for tp in args.tp:
        for line in harness.run_local_ranks(rank_main, tp, (tp, args)):
            harness.emit(line)


if __name__ == "__main__":
    main()
