"""Recovery in place, the supervisor's side (`recovery.in_place`): a lost or hung rank is replaced
inside the running job, and every other rank keeps its process.

On a crash or a hang the supervisor decides here whom to replace: the ranks that ended, or the
silent ranks of a hang, or a rank that failed on its own and waits. It ends them (a frozen or
failing process must not hold its peers' connections open), tells the others to abort their
communicators (NCCL waits on no dead peer's socket) and to rejoin a new generation, a rendezvous
of its own served by the lowest surviving rank, and has a process forked by the launcher's fork
server (mshpc/launch/fork_server.py) take each replaced rank's place, on its node or on a spare
when the node was evicted. The ranks then agree on a snapshot step and go on
(mshpc/snapshot/restore.py).

It cannot help, and the supervisor restarts from disk as before, when the failure is no crash or
hang, when no rank can be named to replace, when a replaced rank's buddy is replaced too (its
snapshot would be gone with both), or when the failure came before the first snapshot. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mshpc.errors import SnapshotsUnusable
from mshpc.launch.detection import Detection, first_failure
from mshpc.launch.hang_report import Missing
from mshpc.launch.monitor import Monitor, RankState
from mshpc.mesh_shape import MeshShape
from mshpc.snapshot.placement import Buddies, buddies


@dataclass(frozen=True)
class Plan:
    replaced: tuple[int, ...]  # ranks whose processes are ended and replaced
    survivors: tuple[int, ...]
    keepers: dict[int, int]  # replaced rank -> the buddy that keeps its snapshot
    ring: str  # how the buddies were drawn

    @property
    def store_rank(self) -> int:
        """The rank that serves the new generation's rendezvous store: the lowest survivor."""
        return self.survivors[0]


@dataclass(frozen=True)
class Generation:
    """What every rank of a new generation is told (the survivors in a rejoin message, a
    replacement in its environment)."""

    number: int
    starts: int  # starts of training so far, restarts and recoveries in place alike (what faults bind to)
    port: int
    store_rank: int

    def rejoin(self, rank: int) -> str:
        """The survivors' word (an abort, then the rejoin) as JSON lines: formatted, not dumped,
        since 12,287 ranks are told at once."""
        return (f'{{"type": "abort", "rank": {rank}}}\n{{"type": "rejoin", "rank": {rank}, "generation": '
                f'{self.number}, "attempt": {self.starts}, "port": {self.port}, "store_rank": {self.store_rank}}}\n')

    def env(self, rank: int, node: str) -> dict[str, str]:
        """A replacement's variables besides the attempt's (RANK, WORLD_SIZE, MASTER_ADDR...)."""
        return {"MSHPC_NODE": node, "MSHPC_NODE_RELAY_START": "0", "MSHPC_REPLACEMENT": "1",
                "MSHPC_GENERATION": str(self.number), "MSHPC_ATTEMPT": str(self.starts),
                "MASTER_PORT": str(self.port), "MSHPC_STORE_RANK": str(self.store_rank)}


def _ended(s: RankState) -> bool:
    """Ended without saying "ok": gone or failed (a stop request is no failure here)."""
    ok = s.exit_code == 0 or (s.outcome or {}).get("type") == "exit"
    return s.ended and not ok


def to_replace(det: Detection, states: Mapping[int, RankState], missing: list[Missing]) -> tuple[int, ...]:
    """The ranks a recovery in place replaces: every rank that ended; else, in a hang, the silent
    ones; else the rank that failed and waits (a process that raised on its own is not trusted
    to go on, and its peers wait on its connections until it ends)."""
    ended = [r for r, s in states.items() if _ended(s)]
    if ended:
        return tuple(sorted(ended))
    if det.kind == "hang":
        return tuple(sorted(m.rank for m in missing if m.why.startswith("silent")))
    found = first_failure(dict(states))
    return (found[0].rank,) if found is not None and found[0].lost is not None else ()


def plan(det: Detection, states: Mapping[int, RankState], missing: list[Missing],
         shape: MeshShape) -> tuple[Plan | None, str]:
    """Whom to replace, or in words why recovery in place cannot help (then: a restart from disk)."""
    if det.kind not in ("crash", "hang"):
        return None, f"a {det.kind.replace('_', ' ')} is no lost or hung rank"
    outcome = states[det.rank].outcome or {} if det.rank is not None else {}
    if outcome.get("error") == SnapshotsUnusable.__name__:
        return None, str(outcome["message"])  # the ranks' own words on what was not whole
    replaced = to_replace(det, states, missing)
    if not replaced:
        return None, "a hang with every rank alive: no rank to replace"
    hosts = [states[r].host or f"unknown-{r}" for r in range(len(states))]
    ring: Buddies = buddies(hosts, shape)
    for r in replaced:
        keeper = ring.buddy[r]
        if keeper in replaced:
            return None, f"rank {r} and its buddy rank {keeper} were both lost"
    not_started = [r for r, s in states.items() if s.start_step is None and r not in replaced]
    if not_started or any(states[r].start_step is None for r in replaced):
        return None, "the failure came while the ranks were starting (before their first snapshot)"
    survivors = tuple(r for r in range(len(states)) if r not in replaced)
    return Plan(replaced, survivors, {r: ring.buddy[r] for r in replaced}, ring.why), ""


@runtime_checkable
class Replaceable(Protocol):
    """Ranks whose launcher can end one rank and start another in its place (the local one)."""

    def kill(self, rank: int) -> None: ...
    def replace(self, rank: int, env: dict[str, str]) -> None: ...


def carry_out(p: Plan, gen: Generation, monitor: Monitor, ranks: Replaceable, nodes: Sequence[str]) -> None:
    """End the replaced ranks, start each replacement on `nodes[rank]`, then tell the survivors to
    abort their communicators and rejoin `gen` (one write per node)."""
    for r in p.replaced:  # first: their sockets close, and the survivors' gloo waits end
        ranks.kill(r)
    for r in p.replaced:
        monitor.replace(r, gen.number)
        ranks.replace(r, gen.env(r, nodes[r]))
    monitor.renew(list(p.survivors), gen.number)
    monitor.send({r: gen.rejoin(r) for r in p.survivors})
