"""A slow rate must be confirmed before it excludes a node: one noisy sample (a neighbour's burst
of load on the host or the fabric) is not evidence. A failing device rate test is run again on
its rank, and a failing pair, or every pair of a node whose link_gbps fails, is exchanged again,
until each has k samples. A record keeps all its samples and its best as its value, held against
the fleet's first samples (verdict.py), so a failure stands only when every sample failed: best
of k, as a health check re-tests before it condemns a node."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mshpc.preflight.record import Record

DEVICE_RATES = ("gemm_tflops", "copy_gbps", "h2d_gbps", "d2h_gbps")  # re-run on the flagged rank
LINK_RATES = ("pair_gbps", "link_gbps")  # from pair exchanges, exchanged again
CONFIRMED = DEVICE_RATES + LINK_RATES


@dataclass(frozen=True)
class Todo:
    """What to measure again, each with the samples it has so far; the same on every rank."""
    pairs: dict[tuple[str, str], int]  # node pair -> samples
    tests: dict[tuple[int, str], int]  # (rank, device test) -> samples

    def __bool__(self) -> bool:
        return bool(self.pairs or self.tests)

    def fewest(self) -> int:
        return min([*self.pairs.values(), *self.tests.values()])


def first_sample(r: Record) -> Record:
    """A rate record as measured once: its value is its first sample."""
    return dataclasses.replace(r, samples=[r.value]) if r.test in CONFIRMED and r.value is not None else r


def _failing(r: Record, k: int) -> bool:
    return r.test in CONFIRMED and r.status == "fail" and r.value is not None and r.sample_count < k


def _pair(device: str) -> tuple[str, str]:
    a, b = device.split("<->")
    return a, b


def to_confirm(records: list[Record], k: int) -> Todo:
    """Judged records -> what to measure again: each failing device rate test on its rank, the
    pairs of failing pair_gbps records, and every pair of a node whose link_gbps fails, while
    they have fewer than k samples."""
    have = {_pair(r.device): r.sample_count for r in records if r.test == "pair_gbps"}
    flagged = {_pair(r.device) for r in records if r.test == "pair_gbps" and _failing(r, k)}
    slow_nodes = {r.node for r in records if r.test == "link_gbps" and _failing(r, k)}
    flagged |= {pair for pair in have if slow_nodes & set(pair)}
    tests = {(r.rank, r.test): r.sample_count for r in records
             if r.test in DEVICE_RATES and r.rank is not None and _failing(r, k)}
    return Todo({pair: have[pair] for pair in sorted(flagged) if have[pair] < k}, tests)


def add_samples(records: list[Record], measured: list[dict]) -> list[Record]:
    """Device records with their re-measurements ({rank, test, value, sample}) added, in the order
    taken; each record's value becomes its best sample."""
    more: dict[tuple[int, str], list[dict]] = {}
    for m in measured:
        more.setdefault((m["rank"], m["test"]), []).append(m)
    out = []
    for r in records:
        extra = sorted(more.get((r.rank, r.test), []), key=lambda m: m["sample"]) if r.rank is not None else []
        if extra:
            samples = [*r.samples, *(m["value"] for m in extra)]
            r = dataclasses.replace(r, samples=samples, value=max(samples))
        out.append(r)
    return out


def settle(records: list[Record], k: int) -> list[Record]:
    """The confirmation rule: a failing rate with fewer than k samples (the level's budget ran out
    before it was measured again) warns instead; it excludes nothing."""
    out = []
    for r in records:
        if _failing(r, k):
            r = dataclasses.replace(r, status="warn", detail=f"{r.detail}; not confirmed: {r.sample_count} of "
                                                             f"{k} samples taken before the level's budget was spent")
        out.append(r)
    return out
