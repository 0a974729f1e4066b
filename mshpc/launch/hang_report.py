"""hang-report.txt: which ranks a hung job is waiting for, and where they are.

Two kinds of evidence name a missing rank. Silence: its heartbeat stopped (a frozen process or a
lost node). Lag: every collective goes through mshpc/parallel/comm.py, which counts the
collectives each rank entered per group; members of a group whose count is below the group's
highest never entered the collective their peers wait in. Each missing rank is given with its
host and (dp, tp, pp) coordinates, then every rank's last collectives and Python stacks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from mshpc.errors import writing_to
from mshpc.launch.detection import Detection
from mshpc.launch.monitor import RankState
from mshpc.regular_files import write_own

REPORT_FILE = "hang-report.txt"
RECORDS_SHOWN = 8


@dataclass(frozen=True)
class Missing:
    rank: int
    why: str  # "silent for 12.0 s (process state T (stopped))" or "missing from all_reduce #57 on world"


def _members(group: str, world: int) -> list[int]:
    return list(range(world)) if group == "world" else json.loads(group)


def _counts(s: RankState) -> dict[str, int]:
    return s.dump["counts"] if s.dump else s.counts


def lagging(states: dict[int, RankState]) -> dict[int, str]:
    """Ranks behind their peers in some group: rank -> which collective they are missing from."""
    behind: dict[int, str] = {}
    groups = {g for s in states.values() for g in _counts(s)}
    for group in sorted(groups):
        members = [r for r in _members(group, len(states)) if r in states]
        highest = max(_counts(states[r]).get(group, 0) for r in members)
        ahead = next(states[r] for r in members if _counts(states[r]).get(group, 0) == highest)
        op = _last_op(ahead, group)
        for r in members:
            if _counts(states[r]).get(group, 0) < highest and r not in behind:
                behind[r] = f"missing from {op} #{highest} on group {group} (entered {_counts(states[r]).get(group, 0)})"
    return behind


def _last_op(s: RankState, group: str) -> str:
    records = s.dump["records"] if s.dump else ([s.last] if s.last else [])
    return next((r[2] for r in reversed(records) if r[1] == group), "a collective")


def process_state(s: RankState, token: str) -> str | None:
    """'T (stopped)' and the like, when the rank's process is on this machine (local slots, or a
    Slurm node on this host): the process is ours only if its environment holds our token."""
    if s.pid is None:
        return None
    try:
        if f"MSHPC_SUPERVISOR_TOKEN={token}".encode() not in Path(f"/proc/{s.pid}/environ").read_bytes().split(b"\0"):
            return None
        status = Path(f"/proc/{s.pid}/status").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")), None)


def missing_ranks(states: dict[int, RankState], silent_after_s: float, started_at: float, token: str) -> list[Missing]:
    now = time.monotonic()
    found = {}
    for s in states.values():
        silent = s.silent_s(now, started_at)
        if silent > silent_after_s and s.dump is None:
            state = process_state(s, token)
            found[s.rank] = f"silent for {silent:.1f} s" + (f" (process state {state})" if state else "")
    for rank, why in lagging(states).items():
        found[rank] = f"{found[rank]}; {why}" if rank in found else why
    return [Missing(r, found[r]) for r in sorted(found)]


def where(s: RankState) -> str:
    return f"rank {s.rank} on {s.host or '?'} {s.coords or ''}".rstrip()


def write_hang_report(path: Path, detection: Detection, states: dict[int, RankState], missing: list[Missing],
                      attempt: int, started_at: float) -> Path:
    """Write the report; returns its path."""
    now = time.monotonic()
    lines = [f"mshpc hang report, attempt {attempt}, {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"detected: {detection.detail}", "", "missing ranks:"]
    lines += [f"  {where(states[m.rank])}: {m.why}" for m in missing] or ["  none found: every rank is "
                                                                         "alive and in step (a network or collective hang)"]
    for s in states.values():
        lines += ["", f"== {where(s)}: phase {s.phase} of step {s.step + 1}, {s.stuck_s(now, started_at):.1f} s in it, "
                  f"last heartbeat {s.silent_s(now, started_at):.1f} s ago"]
        counts = _counts(s)
        lines.append("  collectives entered per group: " + (", ".join(f"{g}: {n}" for g, n in sorted(counts.items())) or "none"))
        records = s.dump["records"] if s.dump else ([s.last] if s.last else [])
        source = "flight recorder" if s.dump else "last heartbeat (no answer to the dump request)"
        lines.append(f"  last collectives ({source}):")
        lines += [f"    #{seq} {op} on {group}, {nbytes} B" for seq, group, op, nbytes in records[-RECORDS_SHOWN:]]
        if s.dump:
            lines.append("  Python stacks (faulthandler):")
            lines += ["    " + line for line in s.dump["stacks"].splitlines()]
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing_to(path):
        write_own(path, "\n".join(lines) + "\n")
    return path
