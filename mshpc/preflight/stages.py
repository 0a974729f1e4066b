"""The suite's stages as one rank runs them: device tests, collectives per group scope,
pairwise link rounds. Between stages and rounds
all ranks agree whether the level's time budget is spent, so they skip the same stages."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mshpc.fault_hooks import FaultHooks
from mshpc.parallel import comm
from mshpc.preflight import device as dev
from mshpc.preflight.burn import burn
from mshpc.preflight.collectives import build_groups, build_op, measure
from mshpc.preflight.hostlist import compress
from mshpc.preflight.links import exchange_gbps, my_peer, schedule
from mshpc.preflight.nvml import Nvml, health
from mshpc.preflight.record import Record
from mshpc.preflight.thresholds import OPS, SCOPES
from mshpc.preflight.tiers import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Where every rank is, gathered once: the same on every rank."""
    rank: int
    node_of_rank: list[str]
    kind_of_rank: list[str]

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(self.node_of_rank))

    @property
    def by_node(self) -> list[tuple[int, ...]]:
        return [tuple(r for r, n in enumerate(self.node_of_rank) if n == node) for node in self.nodes]


class Budget:
    """The level's time budget, agreed on by all ranks of `ctl` (a gloo group)."""

    def __init__(self, seconds: float, ctl: dist.ProcessGroup) -> None:
        self.seconds, self.ctl, self.start = seconds, ctl, time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def spent(self) -> bool:
        """Collective over ctl: whether any rank has used up the budget."""
        elapsed = torch.tensor([self.elapsed_s], dtype=torch.float64)
        comm.all_reduce(elapsed, group=self.ctl, op=dist.ReduceOp.MAX)
        return float(elapsed) > self.seconds

    def skipped(self, layout: Layout, what: str) -> Record:
        return Record(compress(layout.nodes), "all", "stage", None, "", "skip", scope="group",
                      detail=f"{what} skipped: the level's budget of {self.seconds:g} s was spent")


def _guarded(test: str, target: dev.Target, fn: Callable[[], list[Record]]) -> list[Record]:
    """A test that raises (a CUDA error, out of memory) fails with the error, instead of ending
    the run before any verdict is written."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  recorded as this device's failure, with the error
        log.error("%s on %s raised %s: %s", test, target.label, type(exc).__name__, exc)
        return [Record("", target.label, test, None, "", "fail", kind=target.kind,
                       detail=f"{type(exc).__name__}: {exc}")]


def device_tests(target: dev.Target, tier: Tier, burn_s: float, faults: FaultHooks) -> list[Record]:
    """This rank's device tests, NVML health last (temperatures and XIDs after the load)."""
    slow, wrong = faults.gemm_slow_factor, faults.gemm_wrong  # 1 and False unless a gemm_* test fault is planned here
    reps, rep_s = tier.device_reps, tier.device_rep_s
    with Nvml(target) as nvml:
        records = _guarded("gemm_tflops", target, lambda: [dev.gemm_tflops(target, reps, rep_s, slow)])
        records += _guarded("gemm_rel_error", target, lambda: [dev.gemm_correctness(target, wrong)])
        records += _guarded("copy_gbps", target, lambda: [dev.copy_gbps(target, reps, rep_s)])
        records += _guarded("h2d_gbps", target, lambda: dev.host_copy_gbps(target, reps, rep_s))
        if burn_s > 0:
            records += _guarded("burn_tflops", target, lambda: burn(target, nvml, burn_s, slow, wrong))
        records += _guarded("nvml", target, lambda: health(nvml))
    return records


def device_stage(layout: Layout, target: dev.Target, tier: Tier, burn_s: float,
                 faults: FaultHooks) -> list[Record]:
    """This rank's device tests, as records of its node and rank."""
    node = layout.node_of_rank[layout.rank]
    records = device_tests(target, tier, burn_s, faults)
    return [dataclasses.replace(r, node=node, rank=layout.rank) for r in records]


def collective_stage(layout: Layout, target: dev.Target, tier: Tier, budget: Budget) -> tuple[list[dict], list[Record]]:
    """Collective over all ranks: timings of every operation and size in every group of this rank."""
    groups = build_groups(layout.node_of_rank)
    cls = target.device.type
    raw: list[dict] = []
    for scope in SCOPES:  # groups of one scope are disjoint: they run at once
        mine = [g for g in groups if g.scope == scope and layout.rank in g.ranks]
        if not any(g.scope == scope for g in groups):
            continue
        if budget.spent():
            return raw, [budget.skipped(layout, f"collectives from scope {scope} on")]
        for group in mine:
            for op in OPS:
                for size in tier.sizes[cls]:
                    built, actual = build_op(op, size, group, layout.rank, target.device)
                    time_s, wrong = measure(built, group, target.sync, tier.warmup[cls], tier.iters[cls])
                    raw.append({"group": group.name, "scope": scope, "op": op, "size_bytes": actual,
                                "rank": layout.rank, "time_s": time_s, "wrong": wrong})
    return raw, []


def pair_stage(layout: Layout, target: dev.Target, tier: Tier, max_nodes: int, bisections: int,
               budget: Budget) -> tuple[list[dict], list[Record]]:
    """Collective over all ranks: pairwise exchanges between nodes, in rounds of disjoint pairs."""
    if len(layout.nodes) < 2:
        return [], []
    cls = target.device.type
    numel = tier.pair_bytes[cls] // 4
    raw: list[dict] = []
    for round_pairs in schedule(len(layout.nodes), max_nodes, bisections):
        if budget.spent():  # also the barrier between rounds
            return raw, [budget.skipped(layout, "pairwise link rounds")]
        found = my_peer(round_pairs, layout.by_node, layout.rank)
        if found is None:
            continue
        peer, a, b = found
        gbps, wrong = exchange_gbps(layout.rank, peer, numel, target.device, target.sync,
                                    tier.warmup[cls], tier.iters[cls])
        raw.append({"a": layout.nodes[a], "b": layout.nodes[b], "rank": layout.rank, "gbps": gbps,
                    "wrong": wrong, "size_bytes": numel * 4})
    return raw, []
