"""One measurement of the pre-flight suite: what was tested where, the value, and its status."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# worst first: a node's status is the worst of its records'
STATUSES = ("fail", "warn", "na", "skip", "pass", "info")
SEVERITY = {"fail": 3, "warn": 2, "na": 1, "skip": 1, "pass": 0, "info": 0}


@dataclass(frozen=True)
class Record:
    node: str  # one host, or the hostlist of a group (collectives over several nodes)
    device: str  # "cuda:0", "cpu", "ranks 0-7", "n1<->n2"
    test: str  # a metric name of thresholds.METRICS
    value: float | None
    unit: str
    status: str = "info"  # STATUSES; "na": could not be measured here (the detail says why)
    threshold: str = ""  # what the value was held against, e.g. ">= 500 (H100)"
    detail: str = ""
    rank: int | None = None
    kind: str = ""  # the device type its thresholds come from: H100, H200, A100, CPU, ...
    scope: str = "device"  # device | node | link | group
    size_bytes: int | None = None  # collectives and link tests

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Record:
        return Record(**data)


def worst(statuses: list[str]) -> str:
    return max(statuses, key=SEVERITY.__getitem__, default="pass")
