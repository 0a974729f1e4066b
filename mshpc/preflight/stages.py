"""The suite's stages as one rank runs them: device tests, collectives per group scope,
pairwise link rounds, slow links measured again. Between stages and rounds
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
from mshpc.preflight.confirm import Todo, first_sample
from mshpc.preflight.hostlist import compress
from mshpc.preflight.links import disjoint_rounds, exchange_gbps, my_peer, schedule
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


def rate_tests(target: dev.Target, tier: Tier, faults: FaultHooks) -> dict[str, Callable[[], list[Record]]]:
    """The device rate tests, each runnable again to confirm a failure (the host copies give both
    h2d_gbps and d2h_gbps)."""
    reps, rep_s = tier.device_reps, tier.device_rep_s

    def host_copies() -> list[Record]:
        return dev.host_copy_gbps(target, reps, rep_s)
    return {"gemm_tflops": lambda: [dev.gemm_tflops(target, reps, rep_s, faults.gemm_slow_factor)],
            "copy_gbps": lambda: [dev.copy_gbps(target, reps, rep_s)],
            "h2d_gbps": host_copies, "d2h_gbps": host_copies}


def device_tests(target: dev.Target, tier: Tier, burn_s: float, faults: FaultHooks) -> list[Record]:
    """This rank's device tests, NVML health last (temperatures and XIDs after the load)."""
    wrong = faults.gemm_wrong  # False unless a gemm_wrong test fault is planned here
    rates = rate_tests(target, tier, faults)
    with Nvml(target) as nvml:
        records = _guarded("gemm_tflops", target, rates["gemm_tflops"])
        records += _guarded("gemm_rel_error", target, lambda: [dev.gemm_correctness(target, wrong)])
        records += _guarded("copy_gbps", target, rates["copy_gbps"])
        records += _guarded("h2d_gbps", target, rates["h2d_gbps"])
        if burn_s > 0:
            records += _guarded("burn_tflops", target,
                                lambda: burn(target, nvml, burn_s, faults.gemm_slow_factor, wrong))
        records += _guarded("nvml", target, lambda: health(nvml))
    return records


def device_stage(layout: Layout, target: dev.Target, tier: Tier, burn_s: float,
                 faults: FaultHooks) -> list[Record]:
    """This rank's device tests, as records of its node and rank."""
    node = layout.node_of_rank[layout.rank]
    records = device_tests(target, tier, burn_s, faults)
    return [first_sample(dataclasses.replace(r, node=node, rank=layout.rank)) for r in records]


def _measure_again(target: dev.Target, tier: Tier, faults: FaultHooks, tests: list[str]) -> dict[str, float]:
    """This rank's device rate tests `tests` run once more: test -> value (none for one that raised)."""
    rates, values = rate_tests(target, tier, faults), {}
    for test in tests:
        if test not in values:
            values.update({r.test: r.value for r in _guarded(test, target, rates[test]) if r.value is not None})
    return {test: values[test] for test in tests if test in values}


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
    raw: list[dict] = []
    for round_pairs in schedule(len(layout.nodes), max_nodes, bisections):
        if budget.spent():  # also the barrier between rounds
            return raw, [budget.skipped(layout, "pairwise link rounds")]
        raw += _exchange(layout, target, tier, round_pairs)  # the first sample of each pair
    return raw, []


def confirm_stage(layout: Layout, target: dev.Target, tier: Tier, todo: Todo, faults: FaultHooks,
                  budget: Budget) -> tuple[list[dict], list[dict], list[Record]]:
    """Collective over all ranks (each passes the same `todo`): the flagged device tests run again
    on their ranks and the flagged pairs exchanged again, until each has the level's
    confirm_samples, a pause before each pass. Returns this rank's pair exchanges, its device
    samples ({rank, test, value, sample}) and a skip record if the budget ran out."""
    index = {node: i for i, node in enumerate(layout.nodes)}
    k = tier.confirm_samples
    pairs: list[dict] = []
    tests: list[dict] = []
    for more in range(k - todo.fewest()):
        # spread the samples in time, so that one burst of load is not all of them
        time.sleep(tier.confirm_pause_s)
        if budget.spent():  # also lines the ranks up after the pause
            return pairs, tests, [budget.skipped(layout, "measuring slow rates again")]
        mine = [test for (rank, test), have in todo.tests.items() if rank == layout.rank and have + more < k]
        tests += [{"rank": layout.rank, "test": test, "value": value, "sample": todo.tests[(layout.rank, test)] + more}
                  for test, value in _measure_again(target, tier, faults, mine).items()]
        due = [(index[a], index[b]) for (a, b), have in todo.pairs.items() if have + more < k]
        for round_pairs in disjoint_rounds(due):
            if budget.spent():
                return pairs, tests, [budget.skipped(layout, "measuring slow rates again")]
            pairs += [{**r, "sample": todo.pairs[(r["a"], r["b"])] + more}
                      for r in _exchange(layout, target, tier, round_pairs)]
    return pairs, tests, []


def _exchange(layout: Layout, target: dev.Target, tier: Tier, round_pairs: list[tuple[int, int]]) -> list[dict]:
    """This rank's part of one round of pair exchanges: its measurement, or nothing if it sits out."""
    found = my_peer(round_pairs, layout.by_node, layout.rank)
    if found is None:
        return []
    peer, a, b = found
    cls = target.device.type
    numel = tier.pair_bytes[cls] // 4
    gbps, wrong = exchange_gbps(layout.rank, peer, numel, target.device, target.sync,
                                tier.warmup[cls], tier.iters[cls])
    return [{"a": layout.nodes[a], "b": layout.nodes[b], "rank": layout.rank, "gbps": gbps, "wrong": wrong,
             "size_bytes": numel * 4}]
