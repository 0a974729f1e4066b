"""Recovery decisions: what kind of failure it was, which node it blames, and which nodes to use next.

Classes (what a person would conclude from the logs):
  user_error  a config, data or checkpoint error (MshpcError), or the same exception (or the same
              loss divergence) at the same step again after a restart from the same checkpoint:
              deterministic, so a retry cannot help
  environment a full disk or quota where the run writes (RunEnvironmentError): the site's, not the
              node's, and a retry cannot help; nothing is blamed
  node_fault  a rank killed by a signal or gone without a word, a rank silent in a hang, a node
              Slurm reports DOWN/DRAIN/FAIL, a rank found corrupting data silently by replays
              (evicted at once): the node, not the program
  unknown     a Python exception, a first loss divergence, a hang where every rank is alive: retried
Every failure that names a rank blames that rank's node; a node blamed `supervisor.evict_after`
times (or reported down by Slurm at once) is evicted and a spare takes its place.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Literal

from mshpc.errors import RunEnvironmentError, SilentDataCorruption, SnapshotsUnusable
from mshpc.launch.detection import Detection
from mshpc.launch.hang_report import Missing
from mshpc.launch.monitor import RankState

FaultClass = Literal["user_error", "environment", "node_fault", "unknown"]


@dataclass(frozen=True)
class Verdict:
    cls: FaultClass
    blame: tuple[str, ...]  # hosts (local: slots) this failure counts against
    reason: str
    evict_now: bool = False  # the scheduler itself says the node is unusable


@dataclass(frozen=True)
class PastFailure:
    """What makes two failures "the same": kind, step, words, and the checkpoint resumed from.
    Not the rank: a diverged loss is all-reduced, so whichever rank says so first names it, and
    the same divergence from the same checkpoint must not read as a new failure every attempt."""

    kind: str
    step: int
    words: str  # the failing rank's error, without its rank
    resumed_from: int | None

    @staticmethod
    def of(det: Detection, states: dict[int, RankState], resumed_from: int | None) -> PastFailure:
        outcome = states[det.rank].outcome if det.rank is not None else None
        words = f"{outcome['error']}: {outcome['message']}" if outcome and outcome.get("type") == "failed" else det.detail
        return PastFailure(det.kind, det.step, words, resumed_from)


def _host(states: dict[int, RankState], rank: int | None) -> tuple[str, ...]:
    host = states[rank].host if rank is not None else None
    return (host,) if host else ()


def _error_name(states: dict[int, RankState], rank: int | None) -> str | None:
    """The exception type a failed rank named in its last words (the heartbeat's "failed")."""
    outcome = states[rank].outcome if rank is not None else None
    return outcome.get("error") if outcome else None


def classify(det: Detection, states: dict[int, RankState], missing: list[Missing], down: dict[str, str],
             same_as_before: bool) -> Verdict:
    """The verdict on `det`; `down` maps hosts the scheduler reports unusable to their state."""
    if down:
        return Verdict("node_fault", tuple(sorted(down)), "Slurm reports " + ", ".join(
            f"{h} {s}" for h, s in sorted(down.items())), evict_now=True)
    if _error_name(states, det.rank) == SilentDataCorruption.__name__:
        return Verdict("node_fault", _host(states, det.rank), "silent data corruption: the rank's results differed "
                       "from its own replays of the same steps again and again", evict_now=True)
    if _error_name(states, det.rank) == SnapshotsUnusable.__name__:  # every rank says so: no node's fault
        return Verdict("unknown", (), "the in-memory snapshots could not be restored: restart from disk")
    if det.kind == "user_error" and _error_name(states, det.rank) == RunEnvironmentError.__name__:
        return Verdict("environment", (), "the run's file system is full or over quota: not the node's "
                       "fault, and a retry cannot fix it")
    if det.kind == "user_error":
        return Verdict("user_error", (), "a configuration, data or checkpoint error: a retry cannot fix it")
    if same_as_before and det.kind in ("loss", "crash") and states[det.rank or 0].outcome is not None:
        return Verdict("user_error", (), f"the same {det.kind} at the same step after a restart from the same "
                       "checkpoint: deterministic, a retry cannot fix it")
    if det.kind == "loss":
        return Verdict("unknown", (), "loss diverged: retried from the last checkpoint (a silent data "
                       "corruption does not repeat; a divergence does)")
    if det.kind == "crash":
        s = states[det.rank or 0]
        if s.outcome is None and (s.exit_code is None or s.exit_code < 0):  # killed, or its node went away
            return Verdict("node_fault", _host(states, det.rank), "the rank ended without a word (a signal or a lost node)")
        return Verdict("unknown", _host(states, det.rank), "the rank failed (a Python exception or an exit code)")
    silent = [m.rank for m in missing if m.why.startswith("silent")]
    if silent:
        return Verdict("node_fault", tuple(sorted({h for r in silent for h in _host(states, r)})),
                       "hang: rank(s) " + ", ".join(map(str, silent)) + " stopped sending heartbeats")
    if missing:
        return Verdict("unknown", tuple(sorted({h for m in missing for h in _host(states, m.rank)})),
                       "hang: rank(s) " + ", ".join(str(m.rank) for m in missing) + " missing from a collective")
    return Verdict("unknown", (), "hang: every rank alive and level (network or collective hang)")


class NodePool:
    """The nodes (local: slots) a job may use: `active` ones in rank order, then spares."""

    def __init__(self, hosts: list[str], needed: int, evict_after: int) -> None:
        self.active, self.spares = list(hosts[:needed]), list(hosts[needed:])
        self.evict_after = evict_after
        self.blames: collections.Counter[str] = collections.Counter()
        self.evicted: list[str] = []

    def blame(self, host: str) -> int:
        self.blames[host] += 1
        return self.blames[host]

    def should_evict(self, host: str, now: bool) -> bool:
        return host in self.active + self.spares and (now or self.blames[host] >= self.evict_after)

    def evict(self, host: str) -> str | None:
        """Leave `host` out from now on; returns the spare that takes its place (None: none left)."""
        self.evicted.append(host)
        if host in self.spares:
            self.spares.remove(host)
            return None
        i = self.active.index(host)
        if not self.spares:
            self.active.pop(i)
            return None
        self.active[i] = self.spares.pop(0)
        return self.active[i]
