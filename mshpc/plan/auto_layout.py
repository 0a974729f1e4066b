"""`parallel.layout: auto`: the plan's fastest layout that fits, for the world a job actually gets.

Every rank decides alone from the same inputs (the config, the world size, ranks per node and the
device's figures, the smallest over the world), so all ranks take the same layout without
sending it. The config's global batch (train.micro_batch * train.grad_accum * parallel.dp as
written) stays fixed, as in `mshpc plan`; dp, tp, pp, virtual stages, micro-batch (and so
grad_accum) and recomputation are the plan's.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from mshpc.config import (
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PlanConfig,
    TrainConfig,
    check_layout,
    global_batch,
)
from mshpc.errors import ConfigError
from mshpc.parallel import comm
from mshpc.plan.devices import DEVICES, DeviceSpec
from mshpc.plan.layout import CHECKPOINTING, Layout
from mshpc.plan.memory import GIB
from mshpc.plan.report import Prediction, headroom_words, plan

# Predicted step times this close to the fastest are a tie (equal up to float rounding: layouts
# that differ only in how the batch is cut often predict the same time); the simplest of them
# wins (`simplicity`). Anything slower loses, so the choice is `mshpc plan`'s first fitting row
# whenever that row is unique.
TIE = 1e-9
# CPU ranks as the time model sees them. The model FLOP rate per core is the tiny config's
# whole step on the 2-core development machine (`make run`: 5.5-6.0k tokens/s on 2 ranks of one
# thread, 20.8 MFLOP per token: 0.06 TFLOP/s a core), so element-wise work is in it and the
# efficiency is 1. The copy rate and gloo's bus bandwidth between local ranks are estimates
# (benchmarks/plan_vs_measured.py measures them); across nodes gloo runs over TCP, 10 GbE at
# about 90% of its line rate. On CPU the choice turns on compute and memory: these only order
# layouts whose compute is equal.
CPU_TFLOPS_PER_CORE = 0.06
CPU_COPY_GBPS = 8.0
CPU_LOCAL_BUSBW_GBPS = 1.5
CPU_INTER_BUSBW_GBPS = 1.1


def with_layout(parallel: ParallelConfig, train: TrainConfig, lay: Layout) -> tuple[ParallelConfig, TrainConfig]:
    """The two sections trained with layout `lay` (the global batch unchanged: dp * micro_batch * n_micro)."""
    par = dataclasses.replace(parallel, dp=lay.dp, tp=lay.tp, pp=lay.pp, virtual_stages=lay.virtual_stages,
                              activation_checkpointing=lay.checkpointing, ep=lay.ep, zero_stage=lay.zero_stage)
    return par, dataclasses.replace(train, micro_batch=lay.micro_batch, grad_accum=lay.n_micro)


def _engine_accepts(lay: Layout, *, model_cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                    optim: OptimConfig) -> bool:
    """Whether config validation takes this layout: the plan enumerates by divisibility alone,
    the engine also asks tp to divide seq_len and the kv heads, no tp with MLP biases, etc."""
    par, tr = with_layout(parallel, train, lay)
    try:
        check_layout(model=model_cfg, parallel=par, train=tr, optim=optim)
    except ConfigError:
        return False
    return True


def simplicity(lay: Layout) -> tuple[int, int, int, int, int, int, int]:
    """Tie-break among equally fast layouts, smallest first: fewer pipeline stages, then fewer tp
    ranks (fewer collectives the model might miss), fewer virtual stages, less recomputation,
    then the larger micro-batch (bigger GEMMs, which the time model does not credit), then less
    expert parallelism (fewer all-to-alls), then ZeRO stage 2 (half the gathers of stage 3)."""
    return (lay.pp, lay.tp, lay.virtual_stages, CHECKPOINTING.index(lay.checkpointing), -lay.micro_batch, lay.ep,
            lay.zero_stage)


def rank_fitting(predictions: list[Prediction]) -> list[Prediction]:
    """The fitting predictions, best first: those within TIE of the fastest by `simplicity`,
    then the rest by time."""
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        return []
    fastest = min(p.time.total_s for p in fitting)
    tied = [p for p in fitting if p.time.total_s <= fastest * (1 + TIE)]
    rest = [p for p in fitting if p.time.total_s > fastest * (1 + TIE)]
    return sorted(tied, key=lambda p: simplicity(p.layout)) + sorted(
        rest, key=lambda p: (p.time.total_s, simplicity(p.layout)))


@dataclass(frozen=True)
class Choice:
    best: Prediction
    runner_up: Prediction | None
    weighed: int  # layouts the engine accepts
    fitting: int


def _describe(lay: Layout) -> str:
    ep = f" ep {lay.ep}" if lay.ep > 1 else ""
    return (f"dp {lay.dp} tp {lay.tp} pp {lay.pp}{ep} v {lay.virtual_stages} mb {lay.micro_batch} "
            f"grad_accum {lay.n_micro} recompute {lay.checkpointing} zero {lay.zero_stage}")


def _refusal(batch: int, world: int, dev: DeviceSpec, predictions: list[Prediction], plan_cfg: PlanConfig) -> str:
    least = min(predictions, key=lambda p: p.memory.total)
    mem = least.memory
    return (f"parallel.layout=auto: none of the {len(predictions)} layouts of {world} ranks at the global "
            f"batch of {batch} fits in {headroom_words(dev, plan_cfg)} per rank; the "
            f"leanest ({_describe(least.layout)}) needs {mem.total / GIB:.1f} GiB (weights "
            f"{mem.weights / GIB:.1f}, grads {mem.grads / GIB:.1f}, optimizer {mem.optimizer / GIB:.1f}, "
            f"activations {mem.activations / GIB:.1f}); launch more ranks, or shrink the model or the batch")


def choose_layout(world: int, dev: DeviceSpec, ranks_per_node: int, *, model_cfg: ModelConfig,
                  parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig, plan_cfg: PlanConfig) -> Choice:
    """The plan's fastest fitting layout of `world` ranks that the engine accepts, and the next
    one; a ConfigError with the plan's reason when no layout divides the batch or none fits."""
    batch = global_batch(train, parallel)
    try:
        every = plan(world, dev, ranks_per_node, model_cfg=model_cfg, parallel=parallel, train=train, plan_cfg=plan_cfg)
    except ConfigError as exc:  # the world does not divide the batch: say which setting it was
        raise ConfigError(f"parallel.layout=auto on {world} ranks: {exc}") from None
    predictions = [p for p in every
                   if _engine_accepts(p.layout, model_cfg=model_cfg, parallel=parallel, train=train, optim=optim)]
    if not predictions:
        raise ConfigError(f"parallel.layout=auto: no layout of {world} ranks that the engine accepts divides "
                          f"the global batch of {batch} sequences (model.n_head, model.n_layer, "
                          f"model.seq_len); launch another number of ranks")
    ranked = rank_fitting(predictions)
    if not ranked:
        raise ConfigError(_refusal(batch, world, dev, predictions, plan_cfg))
    return Choice(ranked[0], ranked[1] if len(ranked) > 1 else None, len(predictions), len(ranked))


def choice_line(choice: Choice, world: int, dev: DeviceSpec, *, plan_cfg: PlanConfig) -> str:
    """The one start-up line: the layout taken, its prediction, and the runner-up's."""
    best = choice.best
    line = (f"parallel.layout auto on {world} ranks ({headroom_words(dev, plan_cfg)} per rank): "
            f"{_describe(best.layout)}, predicted {best.time.total_s:.4g} s/step, "
            f"{best.memory.total / GIB:.2f} GiB; runner-up ")
    up = choice.runner_up
    if up is None:
        line += "none"
    else:
        line += (f"{_describe(up.layout)}, {up.time.total_s:.4g} s/step "
                 f"({up.time.total_s / best.time.total_s:.3f}x), {up.memory.total / GIB:.2f} GiB")
    return line + f"; {choice.fitting} of {choice.weighed} layouts fit"


def fit_layout(world: int, dev: DeviceSpec, ranks_per_node: int, *, model_cfg: ModelConfig,
               parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig,
               plan_cfg: PlanConfig) -> tuple[ParallelConfig, TrainConfig, str]:
    """The parallel and train sections with the chosen layout, and the line that says so."""
    choice = choose_layout(world, dev, ranks_per_node, model_cfg=model_cfg, parallel=parallel, train=train,
                           optim=optim, plan_cfg=plan_cfg)
    par, tr = with_layout(parallel, train, choice.best.layout)
    return par, tr, choice_line(choice, world, dev, plan_cfg=plan_cfg)


# ---------------------------------------------------------------- this rank's device


def cpu_spec(host_bytes: int, ranks_per_node: int, threads_per_rank: int, act_bytes: int) -> DeviceSpec:
    """A CPU rank as the plan sees it: its share of the host's memory (what a rank runs out of is
    the node's RAM, shared by its ranks), the measured rates above, its threads' GEMM rate."""
    return DeviceSpec(
        f"CPU, {host_bytes / GIB:.1f} GiB host memory / {ranks_per_node} ranks",
        CPU_TFLOPS_PER_CORE * threads_per_rank, host_bytes / ranks_per_node / GIB, CPU_COPY_GBPS,
        CPU_LOCAL_BUSBW_GBPS, CPU_INTER_BUSBW_GBPS, gemm_efficiency=1.0, act_bytes=act_bytes)


def gpu_spec(name: str, memory_bytes: int, act_bytes: int) -> DeviceSpec:
    """The device table's row for a GPU named like 'NVIDIA H100 80GB HBM3', with its real memory."""
    for key, spec in DEVICES.items():
        if key.upper() in name.upper():
            return dataclasses.replace(spec, name=name, memory_gib=memory_bytes / GIB, act_bytes=act_bytes)
    raise ConfigError(f"parallel.layout=auto has no rates for GPU {name!r} (known: {', '.join(DEVICES)}); "
                      f"choose parallel.layout=manual and a layout from `mshpc plan`")


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rank_device_spec(cuda: bool, bf16: bool, local_rank: int, ranks_per_node: int, cpu_threads: int) -> DeviceSpec:
    """This rank's device (`cpu_threads`: train.cpu_threads, 0 for cores / local ranks)."""
    act_bytes = 2 if bf16 else 4
    if cuda:
        props = torch.cuda.get_device_properties(local_rank)
        return gpu_spec(props.name, props.total_memory, act_bytes)
    threads = cpu_threads or max(1, len(os.sched_getaffinity(0)) // ranks_per_node)
    return cpu_spec(host_memory_bytes(), ranks_per_node, threads, act_bytes)


def smallest_over_world(dev: DeviceSpec, ranks_per_node: int, device: torch.device) -> tuple[DeviceSpec, int]:
    """Collective over the world: the smallest memory per rank and ranks per node of any rank, so
    that every rank plans with the same figures (a layout must fit on the fullest node)."""
    figures = torch.tensor([int(dev.memory_gib * GIB), ranks_per_node], dtype=torch.int64, device=device)
    comm.all_reduce(figures, op=torch.distributed.ReduceOp.MIN)
    memory, per_node = (int(v) for v in figures.tolist())
    return dataclasses.replace(dev, memory_gib=memory / GIB), per_node
