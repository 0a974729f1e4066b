"""`train.compile`: each transformer block compiled with torch.compile, torchtitan's per-block
way: after tensor parallelism and activation checkpointing (so the graph holds the block as it
will run, recomputation included; a block that is not one graph, under tp, is compiled before
its checkpoint, which dynamo would otherwise run wholly eagerly; a block holding a mixture of
experts compiles only its attention half, `compiled_region`)
and before ZeRO, whose hooks then wait for a block's weights
outside its graph (`zero_build`: one forward pre-hook per compiled block, not per sub-module,
since a hook inside the graph would be traced and its wait on a collective would break it).

Identical blocks share one compiled graph (their weights are graph inputs, not constants), so
compilation costs one block's, not n_layer's. The mshpc custom operators trace through their
fake implementations (kernels/ops.py); see `compile_kernels` for which ones a compiled block runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mshpc import graph_breaks
from mshpc.kernels.dispatch import REFERENCE, Kernels
from mshpc.model.moe import MoE

log = logging.getLogger(__name__)

# torch's own accounting of compilation (torch._dynamo.utils.compilation_time_metrics): the
# forward graphs (dynamo, AOTAutograd and inductor, nested inside this one) and the backward
# graphs, which AOTAutograd compiles lazily in the first backward.
_COMPILE_METRICS = ("_compile.compile_inner", "backward._backward_impl")


def compile_kernels(mode: str, device: torch.device, kernels: Kernels) -> Kernels:
    """The operators a compiled block runs, for model.fused_kernels = `mode` and `kernels` (what
    the model chose eagerly). On CUDA, `auto` takes the pure-torch references: inductor fuses
    them into its own Triton kernels, which ran 1.8-4.5x faster than mshpc's CUDA kernels on the
    H200 (benchmarks/fused_kernels.py, *_vs_compiled), while a custom operator is opaque to it. On CPU
    the fused C++ twins stay: see docs/benchmarks/kernels_cpu2_2026-12-04.md for the measurement. `on` keeps
    the fused kernels everywhere, as asked."""
    if mode == "auto" and device.type == "cuda" and kernels.fused:
        return REFERENCE
    return kernels


def compiled_region(block: Any) -> tuple[str, list[nn.Module]]:  # Any: a Block, its parts swapped
    """What train.compile compiles of `block`: the method's name and the modules it runs. A block
    holding a mixture of experts (always a serial block) compiles only its attention half,
    torchtitan's regional compilation of MoE blocks: the router, the dispatch and the fp32
    experts would break a whole block's graph several times, each break costing guards and
    splitting the backward, for little gain (docs/moe.md). Any other block compiles whole."""
    if isinstance(getattr(block, "mlp", None), MoE):
        return "attention_half", [block.ln_1, block.attn, block.ln_2]
    return "forward", [block]


def apply_compile(blocks: Iterable[nn.Module], mode: str, device: torch.device, fullgraph: bool) -> None:
    """Compile each block's `compiled_region` in place (parameter names unchanged, so checkpoints
    and resharding see the same model). `fullgraph`: fail on any graph break (no tensor
    parallelism: a region is one graph); under tp the collectives, timed and recorded by
    parallel/comm.py, run eagerly between graphs. `mode` is model.fused_kernels (see
    compile_kernels): it picks the operators of the compiled region only."""
    graph_breaks.apply()  # the functions that run between graphs: marked now, not at import
    chosen = None
    regions = set()
    for block in blocks:
        region, parts = compiled_region(block)
        for module in (m for part in parts for m in part.modules()):
            kernels = getattr(module, "kernels", None)
            if isinstance(kernels, Kernels):
                chosen = compile_kernels(mode, device, kernels)
                setattr(module, "kernels", chosen)  # noqa: B010 - a plain attribute that nn.Module's typing calls Tensor | Module
        regions.add(region)
        # an attention half sees a few static shapes (the micro-batch, its ep slices, validation's);
        # with dynamic ones, under tp dynamo recompiles the chunked collectives' slices (tensor.py)
        # with symbolic bounds, on which inductor (torch 2.13) fails: "Exponent must be non-negative"
        dynamic = False if region == "attention_half" else None
        setattr(block, region, torch.compile(getattr(block, region), fullgraph=fullgraph, dynamic=dynamic))
    if chosen is not None:
        log.info("train.compile: each block's %s compiled (fullgraph=%s) with the %s operators "
                 "(model.fused_kernels=%s on %s)", " or ".join(sorted(regions)), fullgraph,
                 "fused" if chosen.fused else "reference", mode, device.type)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far, by torch's own accounting."""
    from torch._dynamo.utils import compilation_time_metrics  # torch's private table: read here only

    metrics: dict[str, Any] = compilation_time_metrics
    return float(sum(sum(metrics.get(name, ())) for name in _COMPILE_METRICS))
