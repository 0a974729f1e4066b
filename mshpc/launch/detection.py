"""Detection: from what the ranks said (and, locally, how their processes ended) to one decision:
running, finished, stopped on request, or failed (crash, hang, diverged loss, user error).

A crash is a rank that ended without saying "ok": its "failed" message, or its connection and
process ending without one (SIGKILL, a lost node). The earliest such rank is the one that failed;
the others usually only echo it (their peer went away mid-collective). A rank whose error says in
so many words that it echoes another's ("... failed on 1 other rank(s)", from a step that raises
on every rank when one fails; "Connection reset by peer", its transport's) is never the one named while the rank it echoes can still speak,
whichever exited first. A hang is a rank whose current phase has lasted longer than that phase's
timeout (mshpc/launch/timeouts.py), or a rank frozen: its heartbeats stopped for
`supervisor.heartbeat_timeout_s` while it lives, outside set-up and the long phases (a
SIGSTOPped rank's peers wait in a collective for the phase timeout; its own silence says it sooner).
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from typing import Literal

from mshpc.config import SupervisorConfig
from mshpc.errors import USER_ERROR_EXIT
from mshpc.launch.monitor import RankState
from mshpc.launch.timeouts import phase_timeout
from mshpc.phases import LONG, SETUP

Kind = Literal["crash", "hang", "loss", "user_error"]
SETTLE_S = 0.5  # after a first failure, what else ended this soon after is taken in before deciding
ECHO_WAIT_S = 5.0  # how long an echo waits for the failure it echoes, when that rank has not ended yet
# What a rank says when it failed only because another did: parallel.comm.raise_if_any_failed's
# words on the ranks where the step did not fail itself, and the transports' words for a peer
# that went away mid-collective (gloo's TCP pair; NCCL's remote error). A peer killed by SIGKILL
# says nothing, and under load the supervisor may see its end after the survivor's report: read
# as a cause, that report named the survivor (exit 1 instead of the killed rank's 137).
_ECHO = re.compile(r"failed on \d+ other rank\(s\); see their error"
                   r"|Connection (?:reset|closed) by peer|remote process exited or there was a network error")


@dataclass(frozen=True)
class Detection:
    kind: Kind
    rank: int | None  # the failing (crash, loss) or most stuck (hang) rank
    detail: str  # one line, in the words the local launcher always used
    exit_code: int  # the supervisor's own exit code if it gives up here
    time_to_detect_s: float  # from the first sign of the fault (end of rank, start of hung phase)
    phase: str
    step: int
    timeout_s: float | None = None
    timeout_why: str | None = None


def _ended_at(s: RankState) -> float | None:
    """Wall time (time.time) at which a rank failed, or None if it has not (or ended well)."""
    if s.outcome is not None and s.outcome.get("type") == "exit":
        return None
    if s.exit_code == 0:
        return None
    times = [t for t in (s.outcome.get("t") if s.outcome else None, s.exited_at, s.closed_at) if t is not None]
    return min(times, default=None)


def describe(s: RankState) -> tuple[str, int]:
    """How rank `s` ended (or, waiting to recover in place, failed), in one line, and the exit
    code it stands for."""
    code = s.exit_code
    if s.lost is not None and not s.ended:
        why = f"{s.lost['error']}: {s.lost['message']}" if s.lost["message"] else s.lost["error"]
        return f"rank {s.rank} failed: {why}", 1
    if code is not None and code < 0:
        return f"rank {s.rank} was killed by {signal.Signals(-code).name}", 128 - code
    if s.outcome is not None and s.outcome.get("type") == "failed":
        why = f"{s.outcome['error']}: {s.outcome['message']}" if s.outcome["message"] else s.outcome["error"]
        exit_code = code if code is not None else (USER_ERROR_EXIT if s.outcome.get("user_error") else 1)
        return f"rank {s.rank} exited with code {exit_code}: {why}", exit_code
    if code is not None:
        return s.exit_detail or f"rank {s.rank} exited with code {code}", code
    return f"rank {s.rank} on {s.host or 'an unknown host'} vanished (its heartbeat connection closed)", 1


def is_echo(s: RankState) -> bool:
    """Whether rank `s` failed only because another rank did, in its own words."""
    text = (s.outcome or s.lost or {}).get("message") or s.exit_detail or ""
    return bool(_ECHO.search(str(text)))


def first_failure(states: dict[int, RankState]) -> tuple[RankState, float] | None:
    """The failure to name and when it happened: the earliest that is not an echo, else the
    earliest echo. A rank that ended comes before one that raised and waits to recover in place
    ("lost"): a lost peer makes every rank raise, often before its end has been seen."""
    failed = [(s, t) for s in states.values()  # most ranks have not ended: three reads rule them out
              if (s.outcome is not None or s.closed_at is not None or s.exited_at is not None)
              and (t := _ended_at(s)) is not None]
    if not failed:
        failed = [(s, float(s.lost["t"])) for s in states.values() if s.lost is not None]
    causes = [(s, t) for s, t in failed if not is_echo(s)]
    return min(causes or failed, key=lambda st: st[1], default=None)


def _failure(states: dict[int, RankState], now_wall: float, settle_s: float) -> Detection | None:
    found = first_failure(states)
    if found is None or now_wall - found[1] < settle_s:
        return None
    s, at = found
    if is_echo(s) and now_wall - at < ECHO_WAIT_S and not all(r.ended for r in states.values()):
        return None  # the rank it echoes is still to tell its own error
    detail, code = describe(s)
    outcome = s.outcome or s.lost or {}
    user_error = outcome.get("user_error") or (not outcome and s.exit_code == USER_ERROR_EXIT)
    kind: Kind = "loss" if outcome.get("loss_diverged") else "user_error" if user_error else "crash"
    # The first sign is the rank's end itself; the settle wait is part of detecting it.
    return Detection(kind, s.rank, detail, code, max(0.0, now_wall - at), outcome.get("phase", s.phase),
                     outcome.get("step", s.step))


def _slowest_medians(states: dict[int, RankState]) -> dict[str, float]:
    """Each phase's largest median over the ranks (what its timeout is calibrated on), in one pass:
    per rank, it made every check O(N^2), 150 million steps at 12,288 ranks."""
    slowest: dict[str, float] = {}
    for s in states.values():
        for phase, median in s.medians.items():
            if median > slowest.get(phase, -1.0):
                slowest[phase] = median
    return slowest


def _hang(states: dict[int, RankState], cfg: SupervisorConfig, now: float, started_at: float) -> Detection | None:
    """A frozen rank (the one silent longest, past `supervisor.heartbeat_timeout_s`), else the rank
    furthest past its phase's timeout. Within a phase every rank has the same timeout, so only each
    phase's earliest entered rank can be it: one tight pass over the ranks (this runs every poll,
    at 12,288 ranks too), then one timeout per phase."""
    earliest: dict[str, tuple[float, RankState]] = {}  # phase -> (entered at, the rank), supervisor's clock
    quietest: tuple[float, RankState] | None = None  # (last beat, rank): silent longest where silence is a hang
    for s in states.values():
        if s.outcome is not None or s.closed_at is not None or s.exited_at is not None or s.lost is not None:
            continue  # ended (RankState.ended), or waiting for the supervisor's word (lost)
        at = started_at if s.last_beat_at is None else s.last_beat_at - s.phase_s  # now - RankState.stuck_s
        first = earliest.get(s.phase)
        if first is None or at < first[0]:
            earliest[s.phase] = (at, s)
        if (s.last_beat_at is not None and s.phase != SETUP and s.phase not in LONG
                and (quietest is None or s.last_beat_at < quietest[0])):
            quietest = (s.last_beat_at, s)
    if quietest is not None and 0 < cfg.heartbeat_timeout_s < now - quietest[0]:
        return _frozen(quietest[1], now - quietest[0], cfg)
    # a phase's timeout is at least its floor (no medians): past it, the medians are read at all
    past_floor = {p: first for p, first in earliest.items() if now - first[0] > phase_timeout(cfg, p, []).seconds}
    worst = None
    slowest = _slowest_medians(states) if past_floor else {}
    for phase, (at, s) in past_floor.items():
        timeout = phase_timeout(cfg, phase, [slowest[phase]] if phase in slowest else [])
        stuck = now - at
        if stuck > timeout.seconds and (worst is None or stuck - timeout.seconds > worst[1]):
            worst = (s, stuck - timeout.seconds, stuck, timeout)
    if worst is None:
        return None
    s, _, stuck, timeout = worst
    detail = (f"no progress for {stuck:.1f} s in phase {s.phase} of step {s.step + 1} on rank {s.rank} "
              f"(timeout {timeout.seconds:.1f} s: {timeout.why})")
    return Detection("hang", s.rank, detail, 1, stuck, s.phase, s.step, timeout.seconds, timeout.why)


def _frozen(s: RankState, silent: float, cfg: SupervisorConfig) -> Detection:
    """Rank `s`, silent `silent` seconds (past `supervisor.heartbeat_timeout_s`), as a hang."""
    why = f"supervisor.heartbeat_timeout_s={cfg.heartbeat_timeout_s:g}"
    detail = (f"rank {s.rank} frozen: no heartbeat for {silent:.1f} s in phase {s.phase} of step {s.step + 1} "
              f"while its connection stays open ({why})")
    return Detection("hang", s.rank, detail, 1, silent, s.phase, s.step, cfg.heartbeat_timeout_s, why)


def detect(states: dict[int, RankState], cfg: SupervisorConfig, started_at: float,
           settle_s: float = SETTLE_S) -> Detection | None:
    """The failure to act on now, if any (crashes before hangs: a crash makes its peers hang);
    a failure is acted on `settle_s` after it, so that what ended with it is taken in too."""
    return _failure(states, time.time(), settle_s) or _hang(states, cfg, time.monotonic(), started_at)


def settles_in(states: dict[int, RankState], settle_s: float = SETTLE_S) -> float | None:
    """Seconds until the first failure is `settle_s` old and `detect` acts on it (0: now), or
    None when no rank failed: the supervisor wakes then, not at its next poll, which cost every
    crash up to a poll interval of its detection."""
    found = first_failure(states)
    if found is None:
        return None
    return max(0.0, found[1] + settle_s - time.time())


def all_finished(states: dict[int, RankState]) -> bool:
    return all(s.exit_code == 0 or (s.outcome or {}).get("how") == "ok" for s in states.values())


def stop_request(states: dict[int, RankState]) -> int | None:
    """The exit code of a requested stop (the preemption checkpoint), once a rank reports one."""
    for s in states.values():
        if s.outcome is not None and s.outcome.get("how") == "stopped":
            return int(s.outcome["code"] or 0)
    return None
