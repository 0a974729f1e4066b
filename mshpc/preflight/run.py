"""`mshpc preflight` on one rank: bootstrap, run the level's stages, gather every rank's
measurements, judge them the same way on every rank, and (rank 0) write the verdict, the
exclude list and the table; drain failing nodes in admin mode."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist

from mshpc.config import PreflightConfig
from mshpc.fault_hooks import FaultHooks
from mshpc.fault_setup import build_fault_hooks
from mshpc.launch.drain import drain
from mshpc.launch.env import LaunchEnv
from mshpc.launch.rendezvous import init_distributed, shutdown_distributed
from mshpc.parallel import comm
from mshpc.preflight.collectives import collective_records
from mshpc.preflight.confirm import add_samples, settle, to_confirm
from mshpc.preflight.device import Target, build_target
from mshpc.preflight.links import link_records
from mshpc.preflight.options import VERDICT_FAIL_EXIT, Options, check_options
from mshpc.preflight.record import Record
from mshpc.preflight.stages import Budget, Layout, collective_stage, confirm_stage, device_stage, pair_stage
from mshpc.preflight.thresholds import Thresholds, load_thresholds
from mshpc.preflight.tiers import Tier
from mshpc.preflight.verdict import Verdict, judge, table, verdict, write_exclude, write_json

log = logging.getLogger(__name__)

def run_preflight(cfg: PreflightConfig, env: LaunchEnv, opts: Options) -> int:
    """Every rank of the launch calls this; returns the process exit code (the same on every rank)."""
    level = check_options(opts)
    thresholds = load_thresholds(cfg.thresholds)  # a bad file stops here, before any collective
    started = time.time()
    info = init_distributed(env, timeout_s=cfg.timeout_s)
    try:
        # measurements travel as JSON over gloo, whatever the device; the first agreement after the
        # device tests waits for the slowest rank's burn
        ctl = dist.new_group(backend="gloo", timeout=timedelta(seconds=level.budget_s + cfg.timeout_s))
        target = build_target(info.rank, info.local_rank)
        everyone = comm.all_gather_json({"node": info.node, "kind": target.kind}, ctl)
        layout = Layout(info.rank, [e["node"] for e in everyone], [e["kind"] for e in everyone])
        budget = Budget(level.budget_s, ctl)
        faults = build_fault_hooks(env, info)
        records, pair_raw = _measure(layout, target, level, cfg, faults, budget)
        result = verdict(_judge_confirmed(records, pair_raw, layout, target, level, thresholds, faults, budget),
                         layout.nodes)
        if info.rank == 0:
            _report(result, opts, {"level": opts.level, "started": started, "wall_s": time.time() - started,
                                   "ranks": len(layout.node_of_rank)})
        comm.barrier(ctl)  # nobody exits (and so stops the others) before the verdict is written
        return VERDICT_FAIL_EXIT if result.status == "fail" else 0
    finally:
        shutdown_distributed()


def _measure(layout: Layout, target: Target, level: Tier, cfg: PreflightConfig, faults: FaultHooks,
             budget: Budget) -> tuple[list[Record], list[dict]]:
    """Collective over all ranks: every rank's records but the links', in rank order, and the
    pair exchanges that the link records come from, on every rank."""
    burn_s = cfg.burn_s if cfg.burn_s is not None else level.burn_s[target.device.type]
    mine = device_stage(layout, target, level, burn_s, faults)
    log.info("device tests: %.1f s", budget.elapsed_s)
    collective_raw, skipped = collective_stage(layout, target, level, budget)
    log.info("collectives: done at %.1f s", budget.elapsed_s)
    pair_raw, pair_skipped = pair_stage(layout, target, level, cfg.pairwise_max_nodes, cfg.bisections, budget)
    log.info("pairwise links: done at %.1f s", budget.elapsed_s)
    gathered = comm.all_gather_json({"records": [r.to_json() for r in mine], "collectives": collective_raw,
                                     "pairs": pair_raw, "skipped": [r.to_json() for r in skipped + pair_skipped]},
                                    budget.ctl)
    records = [Record.from_json(r) for g in gathered for r in g["records"]]
    records += collective_records([c for g in gathered for c in g["collectives"]], layout.node_of_rank,
                                  layout.kind_of_rank)
    skips = {r["detail"]: r for g in gathered for r in g["skipped"]}  # every rank skipped alike
    return records + [Record.from_json(r) for r in skips.values()], [p for g in gathered for p in g["pairs"]]


def _judge_confirmed(records: list[Record], pair_raw: list[dict], layout: Layout, target: Target, level: Tier,
                     thresholds: Thresholds, faults: FaultHooks, budget: Budget) -> list[Record]:
    """Collective over all ranks: every record judged, once each failing rate has been measured
    the level's confirm_samples times (confirm.py); the same records on every rank."""
    kind_of_node = dict(zip(layout.node_of_rank, layout.kind_of_rank, strict=True))
    judged = judge(records + link_records(pair_raw, kind_of_node), thresholds)
    todo = to_confirm(judged, level.confirm_samples)
    if todo:
        # one pass confirms everything: values only rise and the fleet medians stay on the first
        # samples, so nothing passing before fails after
        pairs, tests, skipped = confirm_stage(layout, target, level, todo, faults, budget)
        gathered = comm.all_gather_json({"pairs": pairs, "tests": tests}, budget.ctl)
        pair_raw = pair_raw + [p for g in gathered for p in g["pairs"]]
        records = add_samples(records, [t for g in gathered for t in g["tests"]]) + skipped
        judged = judge(records + link_records(pair_raw, kind_of_node), thresholds)
        log.info("measured again %d slow pair(s) and %d device test(s): done at %.1f s", len(todo.pairs),
                 len(todo.tests), budget.elapsed_s)
    return settle(judged, level.confirm_samples)


def _report(result: Verdict, opts: Options, header: dict) -> None:
    print(table(result), flush=True)
    if opts.json_path is not None:
        write_json(opts.json_path, result, header)
    if opts.exclude_path is not None:
        write_exclude(opts.exclude_path, result)
    if opts.drain and result.failed_nodes:
        for node, why in _reasons(result).items():
            log.warning("%s", drain(node, f"mshpc-preflight: {why}"))


def _reasons(result: Verdict) -> dict[str, str]:
    """Per failing node, its failed tests, most useful first, for the Slurm drain reason."""
    reasons = {}
    for node in result.failed_nodes:
        failed = [r for r in result.records if r.node == node and r.status == "fail"]
        reasons[node] = "; ".join(f"{r.test} {r.device} {'-' if r.value is None else f'{r.value:.3g}'}" for r in failed)
    return reasons
