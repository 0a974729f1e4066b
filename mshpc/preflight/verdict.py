"""From measurements to a verdict: each record judged against its device type's limits and the
fleet median, each node's status (the worst of its records), the JSON file, the human table
and the exclude list in Slurm's hostlist syntax."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mshpc.preflight.hostlist import compress
from mshpc.preflight.links import judge_pairs
from mshpc.preflight.record import Record, first, worst
from mshpc.preflight.thresholds import METRICS, Rule, Thresholds, beyond, failed_samples

JUDGED = ("info",)  # records still to judge; "na", "skip" and preset failures keep their status


def _scaled(limit: float | None, scale: float) -> float | None:
    return None if limit is None else limit * scale


def _grade(value: float, rule: Rule, better: str, scale: float = 1.0) -> str:
    return ("fail" if beyond(value, _scaled(rule.fail, scale), better)
            else "warn" if beyond(value, _scaled(rule.warn, scale), better) else "pass")


def _failed(r: Record, rule: Rule, better: str, scale: float = 1.0) -> int | None:
    """How many of the record's samples fail `rule`, counted with those that failed an earlier
    rule (limits are one-sided, so the larger count is the union); None without samples."""
    if not r.samples:
        return None
    return max(r.failed or 0, failed_samples(r.samples, _scaled(rule.fail, scale), better))


def _describe(rule: Rule, better: str, what: str) -> str:
    sign = "<" if better == "higher" else ">"
    parts = [f"{name} {sign} {limit:g}{what}" for name, limit in (("fail", rule.fail), ("warn", rule.warn))
             if limit is not None]
    return ", ".join(parts)


def _largest_sizes(records: list[Record]) -> set[int]:
    """Indexes of the records that are judged: of each bus bandwidth, only its largest size (where
    nccl-tests' bus bandwidth approaches the link's); every other record."""
    largest: dict[tuple[str, str, str], int] = {}
    for r in records:
        key = (r.node, r.device, r.test)
        largest[key] = max(largest.get(key, -1), r.size_bytes or -1)
    return {i for i, r in enumerate(records)
            if not r.test.endswith("_busbw_gbps") or (r.size_bytes or -1) == largest[(r.node, r.device, r.test)]}


def _absolute(records: list[Record], th: Thresholds) -> list[Record]:
    judged = _largest_sizes(records)
    out = []
    for i, r in enumerate(records):
        unit, better = METRICS[r.test]
        r = dataclasses.replace(r, unit=unit)
        found = th.absolute(r.kind, r.test)
        if r.status in JUDGED and better and found and r.value is not None and i in judged:
            rule, whose = found
            r = dataclasses.replace(r, status=_grade(r.value, rule, better), failed=_failed(r, rule, better),
                                    threshold=f"{_describe(rule, better, '')} ({whose})")
        out.append(r)
    return out


def _fleet(records: list[Record], th: Thresholds) -> list[Record]:
    """Each fleet-ruled metric against the median of the same metric on the same device type,
    taken over the first samples: every device measured alike, before any was measured again
    (the best of several samples would raise the median over single ones)."""
    judged = _largest_sizes(records)
    groups: dict[tuple[str, str], list[tuple[int, float]]] = {}  # (index, value) by (test, kind)
    for i, r in enumerate(records):
        if r.test in th.fleet and r.value is not None and r.status in ("info", "pass", "warn") and i in judged:
            groups.setdefault((r.test, r.kind), []).append((i, r.value))
    out = list(records)
    for (test, _), members in groups.items():
        median = statistics.median(first(records[i]) for i, _ in members)
        rule, better = th.fleet[test], METRICS[test][1] or "higher"
        for i, value in members:
            r = records[i]
            own = r.status if r.status != "info" else "pass"  # the device-type limit's verdict, if any
            status = worst([_grade(value, rule, better, median), own])
            limit = _describe(rule, better, f" x median {median:.4g}")
            out[i] = dataclasses.replace(r, status=status, failed=_failed(r, rule, better, median),
                                         threshold="; ".join(filter(None, [r.threshold, limit])))
    return out


def judge(records: list[Record], th: Thresholds) -> list[Record]:
    """Every record with its status and the threshold it was held against."""
    return judge_pairs(_fleet(_absolute(records, th), th), th.fleet.get("link_gbps"))


@dataclasses.dataclass(frozen=True)
class Verdict:
    records: list[Record]
    nodes: dict[str, str]  # node -> pass | warn | fail
    status: str  # of the whole run: a group's failure fails it without failing a node

    @property
    def failed_nodes(self) -> list[str]:
        return [n for n, s in self.nodes.items() if s == "fail"]


def verdict(records: list[Record], nodes: Iterable[str]) -> Verdict:
    per_node = {}
    for node in nodes:
        mine = [r.status for r in records if r.node == node and r.status in ("fail", "warn")]
        per_node[node] = worst(mine) if mine else "pass"
    overall = worst([s for s in (r.status for r in records) if s in ("fail", "warn")] or ["pass"])
    return Verdict(records, per_node, overall)


def write_json(path: Path, v: Verdict, header: dict[str, Any]) -> None:
    doc = {**header, "status": v.status, "nodes": v.nodes, "exclude": compress(v.failed_nodes),
           "records": [r.to_json() for r in v.records]}
    _atomic_write(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")


def write_exclude(path: Path, v: Verdict) -> None:
    """The failing nodes as one Slurm hostlist (an empty file when none fail)."""
    _atomic_write(path, (compress(v.failed_nodes) + "\n") if v.failed_nodes else "")


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a reader (train-with-preflight) never sees half a list


def _value(r: Record) -> str:
    return "-" if r.value is None else f"{r.value:.4g}"


def _samples(r: Record) -> str:
    return "" if r.failed is None else f" ({r.failed} of {len(r.samples)} samples failed; the best counts)"


def table(v: Verdict) -> str:
    """The human table: one line per record, then one per node, then the verdict."""
    rows = [("NODE", "DEVICE", "TEST", "SIZE", "VALUE", "UNIT", "STATUS", "THRESHOLD / DETAIL")]
    for r in sorted(v.records, key=lambda r: (r.node, r.device, r.test, r.size_bytes or 0)):
        size = "" if r.size_bytes is None else f"{r.size_bytes / 2**20:g}M"
        rows.append((r.node, r.device, r.test, size, _value(r), r.unit, r.status.upper(),
                     (r.threshold or r.detail) + _samples(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in rows]
    lines += [f"node {node}: {status.upper()}" for node, status in v.nodes.items()]
    failed = compress(v.failed_nodes)
    lines.append(f"preflight: {v.status.upper()}" + (f"; exclude {failed}" if failed else ""))
    return "\n".join(lines)
