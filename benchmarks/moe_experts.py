"""Which way the experts' GEMMs run (model.moe.experts_impl): one torch._grouped_mm per weight for
every expert, or a Python loop of one GEMM per expert; forward and backward of the experts alone
(mshpc/model/moe.py GroupedExperts) on tokens already sorted by expert, in one process, side by
side in rounds (turns alternate). On CPU torch 2.13's _grouped_mm runs a GEMM per group inside
ATen, so the two do the same arithmetic and differ by the loop's Python and autograd nodes; on
CUDA (sm_90) it is one kernel. JSON lines; `ratio` = grouped_mm / loop seconds.

    .venv/bin/python benchmarks/moe_experts.py [--rounds 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from mshpc.bench import harness
from mshpc.kernels.dispatch import select_kernels
from mshpc.model.moe import GroupedExperts

SHAPES = {  # name: (experts, d_model, expert_ffn, token copies)
    "tiny-moe": (8, 256, 256, 2 * 8 * 128),
    "many-small": (64, 256, 128, 8 * 8 * 128),
    "wide": (8, 1024, 2048, 2 * 4 * 256),
}


def step(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor) -> None:
    experts(x, counts).backward(grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_rounds(parser, 7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank's share of the cores)")
    parser.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = select_kernels("auto")
    load = harness.load_average()
    for shape, (e, d, ffn, rows) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        counts = torch.distributions.Multinomial(rows, torch.ones(e)).sample().long()
        x = torch.randn(rows, d, generator=gen, requires_grad=True)
        grad = torch.randn(rows, d, generator=gen)
        built = {}
        for impl in ("grouped_mm", "loop"):
            torch.manual_seed(0)
            experts = GroupedExperts(e, d, ffn, impl, kernels)
            torch.nn.init.normal_(experts.fc, std=0.02)
            torch.nn.init.normal_(experts.proj, std=0.02)
            built[impl] = experts
        samples: dict[str, list[float]] = {name: [] for name in built}
        for r, order in enumerate(harness.turns(list(built), args.rounds + 1)):
            for name in order:
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(built[name], x, counts, grad)
                if r > 0:
                    samples[name].append((time.perf_counter() - start) / args.steps)
        harness.emit({"bench": "moe_experts", "metric": f"experts_fwd_bwd_s_grouped_mm_vs_loop_{shape}", "unit": "s",
                      **harness.paired(samples["grouped_mm"], samples["loop"]), "device": "cpu",
                      "threads": args.threads, "experts": e, "d_model": d, "expert_ffn": ffn, "token_copies": rows,
                      "load_avg": [load, harness.load_average()]})


if __name__ == "__main__":
    main()
