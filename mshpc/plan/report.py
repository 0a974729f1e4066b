"""Rank every layout of a plan and print them: a table for people, JSON lines for programs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from mshpc.config import ModelConfig, ParallelConfig, PlanConfig, RecoveryConfig, TrainConfig, global_batch
from mshpc.diagnose.mfu import flops_per_token
from mshpc.plan.devices import DeviceSpec
from mshpc.plan.layout import Layout, enumerate_layouts, layout_of
from mshpc.plan.memory import GIB, Memory, memory
from mshpc.plan.moe_plan import model_params
from mshpc.plan.snapshots import SnapshotCost, snapshot_cost
from mshpc.plan.steptime import StepTime, dp_bytes, step_time


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool
    dp_bytes: float  # what the dp group's collectives carry per step (steptime.dp_bytes)
    snapshots: SnapshotCost  # recovery in place's in-memory snapshots, per rank

    def to_json(self) -> dict[str, Any]:
        mem = {k: v / GIB for k, v in asdict(self.memory).items() if k != "stage"}
        return {
            **asdict(self.layout), "fits": self.fits, "memory_gib": self.memory.total / GIB,
            "memory_breakdown_gib": mem, "fullest_stage": self.memory.stage,
            "step_time_s": self.time.total_s, "mfu": self.time.mfu, "dp_bytes_per_step": self.dp_bytes,
            "bubble_fraction": self.time.bubble_fraction,
            "time_breakdown_s": {k: v for k, v in asdict(self.time).items() if k != "mfu"},
            "snapshots": self.snapshots.to_json(GIB),
        }


def usable_bytes(device_memory_bytes: float, plan_cfg: PlanConfig) -> float:
    """What a layout may fill of a device: its memory less plan.memory_headroom."""
    return device_memory_bytes * (1.0 - plan_cfg.memory_headroom)


def headroom_words(dev: DeviceSpec, plan_cfg: PlanConfig) -> str:
    """E.g. "72.0 of 80 GiB (H100; plan.memory_headroom 10% kept free)"."""
    usable = usable_bytes(dev.memory_gib * GIB, plan_cfg) / GIB
    return (f"{usable:.1f} of {dev.memory_gib:g} GiB ({dev.name}; plan.memory_headroom "
            f"{plan_cfg.memory_headroom:.0%} kept free)")


def predict(layout: Layout, dev: DeviceSpec, gpus_per_node: int, *, model_cfg: ModelConfig,
            parallel: ParallelConfig, plan_cfg: PlanConfig, recovery: RecoveryConfig | None = None) -> Prediction:
    """Memory and step time of `model_cfg` trained with `layout`; `parallel` gives the overlap
    settings, the pipeline schedule and stage 3's knobs (its dp, tp, pp and stage are the layout's);
    it fits in what plan.memory_headroom leaves of the device; `recovery` how often an in-memory
    snapshot is taken."""
    mem = memory(model_cfg, layout, schedule=parallel.pp_schedule, act_bytes=dev.act_bytes,
                 blocks_per_unit=parallel.zero3_blocks_per_unit, reshard=parallel.reshard_after_forward)
    time = step_time(layout, dev, gpus_per_node, model_cfg=model_cfg, parallel=parallel)
    interval = (recovery or RecoveryConfig()).snapshot_interval_steps
    snapshots = snapshot_cost(model_cfg, layout, dev, time.total_s, interval)
    return Prediction(layout, mem, time, mem.total <= usable_bytes(dev.memory_gib * GIB, plan_cfg),
                      dp_bytes(layout, model_cfg=model_cfg, parallel=parallel), snapshots)


def plan(gpus: int, dev: DeviceSpec, gpus_per_node: int, *, model_cfg: ModelConfig, parallel: ParallelConfig,
         train: TrainConfig, plan_cfg: PlanConfig, recovery: RecoveryConfig | None = None) -> list[Prediction]:
    """Every valid layout at the config's global batch, those that fit first, each group fastest first."""
    layouts = enumerate_layouts(gpus, gpus_per_node, model_cfg=model_cfg, global_batch=global_batch(train, parallel))
    predictions = [predict(lay, dev, gpus_per_node, model_cfg=model_cfg, parallel=parallel, plan_cfg=plan_cfg,
                           recovery=recovery)
                   for lay in layouts]
    return sorted(predictions, key=lambda p: (not p.fits, p.time.total_s))


def format_table(predictions: list[Prediction], dev: DeviceSpec, top: int, *, plan_cfg: PlanConfig) -> str:
    """The `top` predictions as a table; an ep column where some layout has expert parallelism;
    each layout's snapshot size and its traffic's share of the step (recovery in place)."""
    experts = any(p.layout.ep > 1 for p in predictions)
    ep_head = f"{'ep':>4} " if experts else ""
    head = f"{'dp':>5} {'tp':>3} {'pp':>3} {ep_head}{'v':>3} {'mb':>3} {'m':>5} {'recompute':>9} {'zero':>4} " \
           f"{'GiB/GPU':>8} {'fits':>4} {'step s':>8} {'MFU':>6} {'bubble':>6} {'snap GiB':>8} {'snap':>6}"
    lines = [head]
    for p in predictions[:top]:
        lay = p.layout
        ep = f"{lay.ep:>4} " if experts else ""
        lines.append(
            f"{lay.dp:>5} {lay.tp:>3} {lay.pp:>3} {ep}{lay.virtual_stages:>3} {lay.micro_batch:>3} "
            f"{lay.n_micro:>5} {lay.checkpointing:>9} {lay.zero_stage:>4} {p.memory.total / GIB:>8.1f} "
            f"{'yes' if p.fits else 'no':>4} {p.time.total_s:>8.3f} {p.time.mfu:>6.1%} "
            f"{p.time.bubble_fraction:>6.1%} {p.snapshots.snapshot_bytes / GIB:>8.2f} "
            f"{p.snapshots.step_fraction:>6.2%}"
        )
    fitting = sum(p.fits for p in predictions)
    lines.append(f"{len(predictions)} layouts, {fitting} fit in {headroom_words(dev, plan_cfg)}; "
                 f"showing {min(top, len(predictions))}; snap: one rank's in-memory snapshot (recovery.in_place; "
                 f"its host keeps 4 of them) and its copy and send as a share of the step")
    return "\n".join(lines)


def describe_model(m: ModelConfig) -> str:
    """One line: the model's parameters (and, for a mixture of experts, those one token meets)
    and its training FLOPs per token (the routed experts a token meets only)."""
    total = model_params(m)
    active = f", {model_params(m, active=True) / 1e9:.2f}B active per token" if m.moe is not None else ""
    experts = (f" ({m.moe.n_experts} experts, top {m.moe.top_k}, in {m.moe_layers} of {m.n_layer} layers)"
               if m.moe is not None else "")
    return (f"model: {total / 1e9:.2f}B parameters{active}{experts}; "
            f"{flops_per_token(m) / 1e9:.1f} GFLOP per token (forward + backward)")


def format_json(predictions: list[Prediction]) -> str:
    return "\n".join(json.dumps(p.to_json()) for p in predictions)


# Past this multiple of its device's memory a config cannot run however the model errs (the
# model counts the fullest stage exactly up to the allocator's slack): refused, not warned.
REFUSE_FACTOR = 2.0


def memory_refusal(device_memory_bytes: int, device_name: str, act_bytes: int, *, model_cfg: ModelConfig,
                   parallel: ParallelConfig, train: TrainConfig) -> str | None:
    """The one-line reason a config cannot run in `device_memory_bytes` per rank (the plan's
    memory far past it: an absurd size, a typo), else None: said before anything is allocated,
    rather than left to the OOM killer, which would read as a broken node."""
    mem = memory(model_cfg, layout_of(parallel, train), schedule=parallel.pp_schedule, act_bytes=act_bytes)
    if mem.total <= REFUSE_FACTOR * device_memory_bytes:
        return None
    return (f"this config needs about {mem.total / GIB:.3g} GiB per rank (weights {mem.weights / GIB:.3g}, "
            f"optimizer {mem.optimizer / GIB:.3g}, activations {mem.activations / GIB:.3g} at "
            f"train.micro_batch={train.micro_batch}) but {device_name} has {device_memory_bytes / GIB:.1f} GiB; "
            "is a size mistyped? (`mshpc plan` lists layouts that fit)")


def fit_warning(device_memory_bytes: int, device_name: str, *, model_cfg: ModelConfig, parallel: ParallelConfig,
                train: TrainConfig, plan_cfg: PlanConfig) -> str | None:
    """A one-line warning when the config's own layout will not fit on its device, else None.
    Activations are counted in bf16, the GPU default (train.dtype: auto)."""
    mem = memory(model_cfg, layout_of(parallel, train), schedule=parallel.pp_schedule,
                 blocks_per_unit=parallel.zero3_blocks_per_unit, reshard=parallel.reshard_after_forward)
    usable = usable_bytes(device_memory_bytes, plan_cfg)
    if mem.total <= usable:
        return None
    return (f"this layout needs about {mem.total / GIB:.1f} GiB per GPU on pipeline stage {mem.stage} "
            f"(weights {mem.weights / GIB:.1f}, grads {mem.grads / GIB:.1f}, optimizer "
            f"{mem.optimizer / GIB:.1f}, activations {mem.activations / GIB:.1f}) but {device_name} has "
            f"{usable / GIB:.1f} of {device_memory_bytes / GIB:.1f} GiB to give (plan.memory_headroom "
            f"{plan_cfg.memory_headroom:.0%} kept free); `mshpc plan` lists layouts that fit")
