"""The report's views at scale: ranks grouped by node (and by tp or pp group), so that one slow
rank among 12,288 is one bright row among 1,536 nodes, named, and opens down to its ranks.

A node's value is its slowest rank's (the largest compute time, the lowest relative score):
a synchronous step waits for the slowest member of every group, so a node is as slow as its
slowest rank, and a mean over 8 ranks would dim one straggler to an eighth of its excess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from mshpc.diagnose.timings import RankInfo

T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    """A set of ranks reported as one row: a node, or a tp or pp group."""

    name: str  # "node0193", "tp (pp=3, dp=40)", ...
    rows: tuple[int, ...]  # their indices in the list the group was made from, in rank order


def groups_by(items: Sequence[T], key: Callable[[T], str]) -> list[Group]:
    """`items` grouped by `key`, each group in the order of its first item."""
    out: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        out.setdefault(key(item), []).append(i)
    return [Group(name, tuple(rows)) for name, rows in out.items()]


def by_host(ranks: Sequence[RankInfo]) -> list[Group]:
    return groups_by(ranks, lambda r: r.host)


def tp_group(r: RankInfo) -> str:
    return f"tp group (pp={r.coords.pp}, dp={r.coords.dp})"


def pp_group(r: RankInfo) -> str:
    return f"pp group (dp={r.coords.dp}, tp={r.coords.tp})"


def slowest_per_group(values: np.ndarray, groups: list[Group]) -> np.ndarray:
    """(ranks, steps) -> (groups, steps): each group's largest value (NaN where all are NaN)."""
    out = np.full((len(groups), values.shape[1]), np.nan)
    for g, group in enumerate(groups):
        rows = values[list(group.rows)]
        present = ~np.isnan(rows).all(axis=0)
        out[g, present] = np.nanmax(rows[:, present], axis=0)
    return out


def slowest_first(scores: np.ndarray, groups: list[Group]) -> list[tuple[Group, int]]:
    """Groups ordered by their lowest score (slowest first), each with the row of that rank."""
    worst = [(group, min(group.rows, key=lambda i: scores[i])) for group in groups]
    return sorted(worst, key=lambda gw: (scores[gw[1]], gw[0].name))
