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
    # every measurement of a noisy rate (device tests' repetitions, a link's re-measurements):
    # `value` is the best of them, so a failure means that every sample failed
    samples: list[float] = dataclasses.field(default_factory=list)
    failed: int | None = None  # how many of `samples` are beyond the fail limit (set by the judge)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Record:
        return Record(**data)

    @property
    def sample_count(self) -> int:
        """How many measurements decided this record (one unless it keeps its samples)."""
        return max(1, len(self.samples))


def first(r: Record) -> float:
    """A measured record's first sample: what the fleet's median is taken over."""
    assert r.value is not None, r
    return r.samples[0] if r.samples else r.value


def worst(statuses: list[str]) -> str:
    return max(statuses, key=SEVERITY.__getitem__, default="pass")
