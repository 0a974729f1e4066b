"""The supervisor: start the ranks, watch their heartbeats, and on a crash, hang or diverged loss
stop them all, say why, evict a node blamed twice, and restart from the latest good checkpoint,
up to `supervisor.max_restarts` times. It runs where the ranks are started: `mshpc train --nproc N`
(local ranks on simulated nodes, "slots") and the batch script of a Slurm job (one srun per attempt).

Every decision is an event in <run dir>/events.jsonl; at the end, `run_end` gives the effective
training time ratio, the failures, the times to detect and to recover.

SIGTERM or SIGHUP to a local supervisor stops the run as scancel does under Slurm: the ranks
checkpoint at their next step boundary (at once if they have not begun training, or on a second
signal), then `run_end` and a last line; no restart follows.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mshpc import full_disk
from mshpc.config import ParallelConfig, RecoveryConfig, SupervisorConfig
from mshpc.errors import USER_ERROR_EXIT
from mshpc.events import append_event
from mshpc.launch.detection import SETTLE_S, Detection, all_finished, detect, settles_in, stop_request
from mshpc.launch.hang_report import REPORT_FILE, Missing, missing_ranks, where, write_hang_report
from mshpc.launch.in_place import Generation, Replaceable, carry_out, plan
from mshpc.launch.monitor import Monitor, RankState
from mshpc.launch.ports import free_port
from mshpc.launch.recovery import NodePool, PastFailure, Verdict, classify
from mshpc.launch.requeue import STOP_REQUEST_SIGNAL, JobStopped, latest_checkpoint_step
from mshpc.launch.stop_signals import stop_signals_to
from mshpc.mesh_shape import MeshShape
from mshpc.run_dir import METRICS_FILE, read_metrics
from mshpc.run_lock import hold_run_lock

log = logging.getLogger(__name__)

POLL_S = 0.2
# A check (detection over every rank) follows every message that may need a decision, but takes
# at most this share of the supervisor's time: 12,288 ranks saying "started" at once would
# otherwise run thousands of 10 ms checks back to back and starve the monitor's loop
CHECK_SHARE = 0.1
# The pause after a check is paid before the next failure is seen: never longer than a poll
MAX_PAUSE_S = POLL_S
DUMP_WAIT_S = 5.0  # how long live ranks get to send their stacks for the hang report
EXIT_WAIT_S = 60.0  # ranks that all said "ok" get this long to exit before they are stopped
# A recovery in place replaces every rank that has ended by the time it acts, and one that ends
# later is another failure, recovered from alike: it needs less of a wait for the rest of an
# incident to show than a restart, which is decided once (detection.SETTLE_S)
IN_PLACE_SETTLE_S = 0.2
LAST_WORDS_WAIT_S = 5.0  # how long rank 0's last message may trail the exit of its process
# Verdicts that no restart can fix: the run ends with USER_ERROR_EXIT and the failure's line
NOT_RETRIED: tuple[str, ...] = ("user_error", "environment")


class Ranks(Protocol):
    """One attempt's ranks, however they were started (local processes, an srun step)."""

    def update(self, states: dict[int, RankState]) -> None: ...  # what the launcher knows of exits
    def request_stop(self) -> None: ...  # ask for a checkpoint at the next step boundary, then exit
    def stop(self, grace_s: float) -> list[int]: ...  # SIGTERM, then SIGKILL; ranks that needed it


@runtime_checkable
class WakesOnExit(Protocol):
    """Ranks whose launcher sees each exit itself (the local one): it sets the supervisor's event
    then, rather than the supervisor finding the exit at its next poll."""

    def wake_on_exit(self, event: threading.Event) -> None: ...


# start(attempt, hosts, env for every rank) -> the running ranks
Starter = Callable[[int, list[str], dict[str, str]], Ranks]
# hosts the scheduler reports unusable, with their state (Slurm's sinfo; nothing locally)
DownCheck = Callable[[list[str]], dict[str, str]]
# what to do when an evicted node leaves too few: requeue elsewhere (Slurm) or give up (None)
Requeue = Callable[[list[str]], bool]


@dataclass
class Attempt:
    number: int
    hosts: list[str]
    started_at: float  # monotonic
    resumed_from: int | None = None  # the step the ranks resumed from (rank 0 tells it at once)
    first_step_at: float | None = None  # when a first step finished: training goes on
    generation: int = 0  # recoveries in place within this attempt
    kind: str = "disk"  # how the ranks now training recovered: from disk (or a first start), or in place
    ready_pending: bool = False  # a generation started in place: "generation_ready" once every rank trains
    rejoined_at: float = 0.0  # monotonic, when the ranks were told to rejoin


@dataclass(frozen=True)
class Seen:
    """A failure the watch loop saw and no recovery in place resolved."""

    detection: Detection
    missing: list[Missing]  # a hang's missing ranks, from its report
    verdict: Verdict | None  # classified already when a recovery in place was tried


@dataclass(frozen=True)
class Failure:
    """An attempt's failure: what detection saw, and the verdict classification gave."""

    detection: Detection
    verdict: Verdict


@dataclass
class Tally:
    """What `run_end` reports."""

    started_wall: float = field(default_factory=time.time)
    failures: list[str] = field(default_factory=list)
    detect_s: list[float] = field(default_factory=list)
    recover_s: list[float] = field(default_factory=list)
    detected_at: float | None = None  # monotonic, of the failure being recovered from
    trained_from: int | None = None  # the lowest step an attempt of this run resumed training at
    kinds: list[str] = field(default_factory=list)  # each recovery's kind, in order: "disk", "in_place"


class Supervisor:
    """`world` ranks on `pool`'s nodes, each attempt started by `start`; the run's events go to
    `run_dir`, restarts resume from the newest checkpoint under `checkpoints`."""

    def __init__(self, world: int, pool: NodePool, start: Starter, bind_host: str, *,
                 supervisor: SupervisorConfig, spare_nodes: int, run_dir: Path, checkpoints: Path,
                 down: DownCheck = lambda hosts: {}, requeue: Requeue | None = None,
                 recovery: RecoveryConfig | None = None, parallel: ParallelConfig | None = None) -> None:
        self.scfg, self.spare_nodes, self.world, self.pool = supervisor, spare_nodes, world, pool
        self.start, self.bind_host, self.down, self.requeue = start, bind_host, down, requeue
        self.run_dir, self.checkpoints = run_dir, checkpoints
        self.tally = Tally()
        self.past: PastFailure | None = None
        self.stopping = False  # set when the job is told to stop (scancel, time limit): no restarts
        self.requeued = False
        self.stop_signal: int | None = None  # the first stop signal this supervisor received
        self.stop_signals = 0  # how many: a second one stops the ranks at once
        self.recovery = recovery or RecoveryConfig()  # off unless given
        p = parallel or ParallelConfig()  # in place: whom to replace needs the mesh (each rank's buddy)
        self.shape = MeshShape(pp=p.pp, dp=world // (p.tp * p.pp), tp=p.tp)
        self.restarts = 0  # recoveries so far, from disk and in place alike (supervisor.max_restarts)
        self.starts = 0  # starts of training so far (what MSHPC_ATTEMPT tells the ranks, and faults bind to)
        self._refused: str | None = None  # why the last failure could not be recovered in place

    def request_stop(self, signum: int) -> None:
        """A stop signal (SIGTERM, SIGHUP) to this supervisor; runs in the signal handler, so it
        only counts: the watch loop passes it on to the ranks."""
        self.stopping = True
        self.stop_signal = self.stop_signal or signum
        self.stop_signals += 1

    def event(self, kind: str, **fields: Any) -> None:
        append_event(self.run_dir, kind, **fields)

    # ---------------------------------------------------------------- the attempts

    def run(self) -> int:
        """Train to the end, restarting as allowed; returns the exit code for the caller, or
        raises JobStopped (a SystemExit) when the job stopped on request or was requeued. The
        run directory is locked from before the first event to after `run_end`."""
        full_disk.hold_for(self.recovery.full_disk_hold_s)  # this process's writes of the run's files
        with hold_run_lock(self.run_dir):
            return self._run()

    def _run(self) -> int:
        self.event("supervisor_start", world=self.world, hosts=self.pool.active, spares=self.pool.spares,
                   knobs={**dataclasses.asdict(self.scfg), "spare_nodes": self.spare_nodes})
        number = 0
        while True:
            code, failure = self._attempt(number)
            if failure is None and code == 0:
                return self._end("finished", code)
            if failure is None:  # stopped on request after a checkpoint: as the ranks did, not a failure
                raise JobStopped(self._stopped(code))
            if not self._recoverable(failure.verdict, self.restarts):
                return self._failed(failure)
            self.restarts += 1
            self.starts += 1
            number += 1

    def _failed(self, failure: Failure) -> int:
        """The end after a failure that is not retried; the last line says what failed."""
        det = failure.detection
        no_retry = failure.verdict.cls in NOT_RETRIED
        code = self._end("requeued" if self.requeued else "failed", USER_ERROR_EXIT if no_retry else det.exit_code)
        if self.requeued:  # the job goes on elsewhere: no result to record (submitit)
            raise JobStopped(code)
        print(f"mshpc: {det.detail}", file=sys.stderr)
        return code

    def _stopped(self, code: int) -> int:
        """The end of a run stopped on request; the exit code is 128 + the signal, as a shell reports."""
        if self.stop_signal is not None:  # this supervisor's signal; else the ranks' (Slurm's, to them)
            code = 128 + self.stop_signal
        code = self._end("stopped", code)
        why = signal.Signals(self.stop_signal).name if self.stop_signal else f"a stop request to the ranks (exit {code})"
        latest = latest_checkpoint_step(self.checkpoints)
        print(f"mshpc: stopped by {why}; latest checkpoint: {'none' if latest is None else f'step {latest}'} "
              "(the same command resumes from it)", file=sys.stderr)
        return code

    def _attempt(self, number: int) -> tuple[int, Failure | None]:
        """One attempt, from starting its ranks to stopping them: its exit code, and its failure
        (None when the ranks finished or stopped on request)."""
        token = uuid.uuid4().hex
        monitor = Monitor(self.world, token, self.bind_host)
        address = socket.gethostname() if self.bind_host != "127.0.0.1" else "127.0.0.1"
        env = {"MSHPC_SUPERVISOR": f"{address}:{monitor.port}", "MSHPC_SUPERVISOR_TOKEN": token,
               "MSHPC_ATTEMPT": str(self.starts)}
        attempt = Attempt(number, list(self.pool.active), time.monotonic())
        self.event("attempt_start", attempt=number, hosts=attempt.hosts)
        ranks = self.start(number, attempt.hosts, env)
        if isinstance(ranks, WakesOnExit):  # a stop's or a finished run's end is seen at once
            ranks.wake_on_exit(monitor.changed)
        try:
            code, seen = self._watch(monitor, ranks, attempt, token)
            if seen is None:
                self._last_words(monitor, attempt)
                return code, None
            return code, Failure(seen.detection, self._handle(seen, monitor, ranks, attempt))
        finally:
            ranks.stop(self.scfg.stop_grace_s)
            monitor.close()

    def _watch(self, monitor: Monitor, ranks: Ranks, attempt: Attempt,
               token: str) -> tuple[int, Seen | None]:
        done_at, passed = None, 0  # passed: the stop signals handled in this attempt
        began: float | None = None  # of the last pass, in this thread's CPU time
        wait_s, settle_s = POLL_S, IN_PLACE_SETTLE_S if self.recovery.in_place else SETTLE_S
        while True:
            if began is not None:  # microseconds at a few ranks
                time.sleep(check_pause(time.thread_time() - began))
            monitor.changed.wait(wait_s)
            monitor.changed.clear()
            began = time.thread_time()
            ranks.update(monitor.ranks)
            self._track(monitor.ranks, attempt)
            # finished, or stopping on request (a checkpoint after a signal): let the ranks exit
            # on their own (teardown, submitit's result files) before stopping any
            code = 0 if all_finished(monitor.ranks) else stop_request(monitor.ranks)
            if self.stop_signals > passed:
                at_once = passed > 0 or (code is None and monitor.ranks[0].start_step is None)
                passed = self.stop_signals
                if at_once:
                    return self._stop_now(ranks, attempt), None
                if code is None:
                    self._ask_to_stop(ranks, attempt)
            if code is not None:
                done_at = done_at or time.monotonic()
                exited = all(s.exited_at is not None for s in monitor.ranks.values())
                if exited or time.monotonic() - done_at > EXIT_WAIT_S:
                    return code, None
                continue
            self._ready(monitor.ranks, attempt)
            det = detect(monitor.ranks, self.scfg, attempt.started_at, settle_s)
            # a failure still settling is acted on once it has, not at the next poll (0: settled,
            # an echo waiting for its cause, which ends with news or the poll)
            pending = settles_in(monitor.ranks, settle_s) if det is None else None
            wait_s = min(POLL_S, pending + 0.005) if pending else POLL_S
            if det is not None:
                missing = self._detected(det, monitor, attempt, token)
                recovered, verdict = self._in_place(det, monitor, ranks, attempt, missing)
                if not recovered:
                    return det.exit_code, Seen(det, missing, verdict)
                began = None  # a recovery, not a check: the checks' share does not pay for it

    def _ask_to_stop(self, ranks: Ranks, attempt: Attempt) -> None:
        """The ranks train: they checkpoint at their next step boundary and exit (stop_request);
        the hang timeouts still apply meanwhile."""
        assert self.stop_signal is not None
        name = signal.Signals(self.stop_signal).name
        self.event("stop_requested", attempt=attempt.number, signal=name, how="a checkpoint at the next step")
        log.warning("supervisor: %s: the ranks stop after a checkpoint at the next step (again: at once)", name)
        ranks.request_stop()

    def _stop_now(self, ranks: Ranks, attempt: Attempt) -> int:
        """Still in set-up (nothing to checkpoint yet), or a second signal: stop the ranks now."""
        assert self.stop_signal is not None
        self.event("stop_requested", attempt=attempt.number, signal=signal.Signals(self.stop_signal).name,
                   how="at once")
        began = time.monotonic()
        killed = ranks.stop(self.scfg.stop_grace_s)
        self.event("ranks_stopped", attempt=attempt.number, stop_s=time.monotonic() - began, sigkilled=killed)
        return 128 + self.stop_signal

    def _last_words(self, monitor: Monitor, attempt: Attempt) -> None:
        """An exit seen by the launcher can overtake the rank's last message in the monitor's
        thread: read rank 0's connection to its end (bounded) so the story is told from it."""
        first, deadline = monitor.ranks[0], time.monotonic() + LAST_WORDS_WAIT_S
        while first.outcome is None and first.closed_at is None and time.monotonic() < deadline:
            monitor.changed.wait(POLL_S)
            monitor.changed.clear()
        self._track(monitor.ranks, attempt)

    def _track(self, states: dict[int, RankState], attempt: Attempt) -> None:
        """Note where the attempt resumed and when its first step finished (recovery time): from
        rank 0's "started" message and last words, which come whatever the beat interval."""
        first = states[0]
        if attempt.resumed_from is None and first.start_step is not None:
            attempt.resumed_from = first.start_step
            before = self.tally.trained_from
            self.tally.trained_from = first.start_step if before is None else min(before, first.start_step)
            # the PIDs the ranks said hello with (every rank did, before rank 0 trains)
            self.event("resumed", attempt=attempt.number, recovery=attempt.kind, from_step=first.start_step,
                       pids=[states[r].pid for r in sorted(states)])
        trained = first.start_step is not None and first.step > first.start_step
        if attempt.first_step_at is None and (trained or (first.outcome or {}).get("how") == "ok"):
            attempt.first_step_at = time.monotonic()
            if self.tally.detected_at is not None:
                took = attempt.first_step_at - self.tally.detected_at
                self.tally.recover_s.append(took)
                self.tally.kinds.append(attempt.kind)
                self.event("recovered", attempt=attempt.number, recovery=attempt.kind, generation=attempt.generation,
                           time_to_recover_s=took, resumed_from=attempt.resumed_from,
                           pids=[states[r].pid for r in sorted(states)])

    # ---------------------------------------------------------------- a failure

    def _detected(self, det: Detection, monitor: Monitor, attempt: Attempt, token: str) -> list[Missing]:
        """Record a failure (and, for a hang, write the report); returns the hang's missing ranks."""
        states = monitor.ranks
        self.tally.detected_at = time.monotonic()
        self.tally.failures.append(det.kind)
        self.tally.detect_s.append(det.time_to_detect_s)
        s = states[det.rank] if det.rank is not None else None
        self.event("failure_detected", attempt=attempt.number, failure=det.kind, rank=det.rank,
                   host=s.host if s else None, coords=s.coords if s else None, phase=det.phase,
                   step=det.step + 1, detail=det.detail, time_to_detect_s=det.time_to_detect_s,
                   timeout_s=det.timeout_s, timeout_why=det.timeout_why)
        log.warning("supervisor: %s", det.detail)
        return self._report_hang(det, monitor, attempt, token) if det.kind == "hang" else []

    def _handle(self, seen: Seen, monitor: Monitor, ranks: Ranks, attempt: Attempt) -> Verdict:
        """Stop every rank of the attempt, then say what the failure was (its verdict, unless a
        recovery in place that could not help classified it already)."""
        began = time.monotonic()
        killed = ranks.stop(self.scfg.stop_grace_s)
        self.event("ranks_stopped", attempt=attempt.number, stop_s=time.monotonic() - began, sigkilled=killed)
        if seen.verdict is not None:
            return seen.verdict
        return self._classify(seen.detection, monitor.ranks, seen.missing, attempt)

    def _classify(self, det: Detection, states: dict[int, RankState], missing: list[Missing], attempt: Attempt) -> Verdict:
        same = self.past == (now := PastFailure.of(det, states, attempt.resumed_from))
        self.past = now
        verdict = classify(det, states, missing, self.down(attempt.hosts), same)
        self.event("classified", attempt=attempt.number, fault_class=verdict.cls, blame=list(verdict.blame),
                   reason=verdict.reason)
        return verdict

    # ---------------------------------------------------------------- recovery in place

    def _ready(self, states: dict[int, RankState], attempt: Attempt) -> None:
        """Once every rank of a generation started in place trains, say so."""
        if attempt.ready_pending and all(s.start_step is not None for s in states.values()):
            self.event("generation_ready", attempt=attempt.number, generation=attempt.generation,
                       ready_s=time.monotonic() - attempt.rejoined_at)
            attempt.ready_pending = False

    def _in_place(self, det: Detection, monitor: Monitor, ranks: Ranks, attempt: Attempt,
                  missing: list[Missing]) -> tuple[bool, Verdict | None]:
        """Recover from `det` inside the running attempt (mshpc/launch/in_place.py): whether it
        did, and the failure's verdict when classified. False, with an event saying why, when that
        cannot help: the caller restarts from disk."""
        self._refused = None
        if not self.recovery.in_place:
            return False, None
        states = monitor.ranks
        verdict = self._classify(det, states, missing, attempt)
        chosen, why = plan(det, states, missing, self.shape)
        why = why or self._cannot_recover(verdict, ranks)
        if chosen is None or why:
            self._refused = why
            self.event("in_place_refused", attempt=attempt.number, why=why)
            log.warning("supervisor: no recovery in place: %s; restarting from disk", why)
            return False, verdict
        for host in verdict.blame:
            count = self.pool.blame(host)
            if self.pool.should_evict(host, verdict.evict_now):
                self._evict(host, count, verdict)  # a spare is free (_cannot_recover checked)
        per = self.world // len(attempt.hosts)
        attempt.hosts = list(self.pool.active)
        self.restarts, self.starts, attempt.generation = self.restarts + 1, self.starts + 1, attempt.generation + 1
        gen = Generation(attempt.generation, self.starts, free_port(), chosen.store_rank)
        nodes = [attempt.hosts[r // per] for r in range(self.world)]
        assert isinstance(ranks, Replaceable)
        kept = [{"rank": r, "pid": states[r].pid} for r in chosen.survivors]
        carry_out(chosen, gen, monitor, ranks, nodes)
        self.event("recover_in_place", attempt=attempt.number, generation=gen.number, store_rank=gen.store_rank,
                   replaced=[{"rank": r, "node": nodes[r], "buddy": chosen.keepers[r]} for r in chosen.replaced],
                   kept=kept, ring=chosen.ring)
        log.warning("supervisor: recovering in place: rank(s) %s replaced, generation %d",
                    ", ".join(map(str, chosen.replaced)), gen.number)
        attempt.resumed_from, attempt.first_step_at, attempt.kind = None, None, "in_place"
        attempt.ready_pending, attempt.rejoined_at = True, time.monotonic()
        return True, verdict

    def _cannot_recover(self, verdict: Verdict, ranks: Ranks) -> str:
        """Why no recovery at all, or in place, may follow this verdict; "" when one may."""
        if not isinstance(ranks, Replaceable):
            return "this launcher cannot replace one rank (a Slurm job step starts and ends whole)"
        if verdict.cls in NOT_RETRIED:
            return f"a {verdict.cls.replace('_', ' ')}: {verdict.reason}"
        if self.stopping:
            return "the job is stopping"
        if self.restarts >= self.scfg.max_restarts:
            return f"supervisor.max_restarts={self.scfg.max_restarts} recoveries used"
        evicted = [h for h in verdict.blame if h in self.pool.active
                   and (verdict.evict_now or self.pool.blames[h] + 1 >= self.pool.evict_after)]
        if len(evicted) > len(self.pool.spares):
            return f"{', '.join(evicted)} to be evicted and no spare left"
        return ""

    def _report_hang(self, det: Detection, monitor: Monitor, attempt: Attempt, token: str) -> list[Missing]:
        """Before anything is stopped: every live rank's stacks and flight recorder, the missing
        ranks, hang-report.txt."""
        states = monitor.ranks
        silent_after = max(3 * self.scfg.heartbeat_interval_s, 2.0)
        if self.scfg.heartbeat_timeout_s > 0:  # a rank detected frozen is silent past this: missing
            silent_after = min(silent_after, self.scfg.heartbeat_timeout_s)
        began = time.monotonic()
        monitor.request_dumps(min(DUMP_WAIT_S, self.scfg.stop_grace_s + 1), silent_after)
        asked = time.monotonic()
        missing = missing_ranks(states, silent_after, attempt.started_at, token)
        path = write_hang_report(self.run_dir / REPORT_FILE, det, states, missing, attempt.number, attempt.started_at)
        # how long the dumps took to come (bounded by DUMP_WAIT_S) and the report to be written
        self.event("hang_report", attempt=attempt.number, path=str(path), dumps_s=asked - began,
                   write_s=time.monotonic() - asked,
                   missing=[{"rank": m.rank, "host": states[m.rank].host, "coords": states[m.rank].coords,
                             "why": m.why} for m in missing])
        for m in missing:
            log.warning("supervisor: missing %s: %s", where(states[m.rank]), m.why)
        return missing

    def _recoverable(self, verdict: Verdict, restarts: int) -> bool:
        """Evict what `verdict` blames; then whether a restart is allowed and possible."""
        if verdict.cls in NOT_RETRIED:
            return False
        for host in verdict.blame:
            count = self.pool.blame(host)
            if self.pool.should_evict(host, verdict.evict_now) and not self._evict(host, count, verdict):
                return False
        if self.stopping:
            self.event("gave_up", reason="the job is stopping (a signal came)")
            return False
        if restarts >= self.scfg.max_restarts:
            self.event("gave_up", reason=f"supervisor.max_restarts={self.scfg.max_restarts} restarts used")
            return False
        latest = latest_checkpoint_step(self.checkpoints)
        self.event("restart", attempt=restarts + 1, hosts=self.pool.active, latest_checkpoint=latest, recovery="disk",
                   **({"why_not_in_place": self._refused} if self._refused else {}))
        log.warning("supervisor: restart %d of %d on %s from the latest good checkpoint (newest: %s)",
                    restarts + 1, self.scfg.max_restarts, ",".join(self.pool.active), latest)
        return True

    def _evict(self, host: str, blames: int, verdict: Verdict) -> bool:
        replacement = self.pool.evict(host)
        self.event("evicted", node=host, blames=blames, reason=verdict.reason, replacement=replacement)
        log.warning("supervisor: evicted %s (%s); %s", host, verdict.reason,
                    f"{replacement} takes its place" if replacement else "no spare left")
        if self.scfg.drain:
            from mshpc.launch.drain import drain

            self.event("drain", node=host, result=drain(host, f"mshpc: {verdict.reason}"))
        if replacement is not None:
            return True
        if self.requeue is not None:
            self.event("requeue", exclude=self.pool.evicted)
            self.requeued = self.requeue(self.pool.evicted)  # the job restarts elsewhere, not here
            return False
        self.event("gave_up", reason=f"{host} evicted and no spare left (train.spare_nodes={self.spare_nodes})")
        return False

    # ---------------------------------------------------------------- the end

    def _end(self, outcome: str, code: int) -> int:
        wall = time.time() - self.tally.started_wall
        useful = useful_step_seconds(self.run_dir / METRICS_FILE, self.tally.trained_from)
        t = self.tally
        self.event("run_end", outcome=outcome, exit_code=code, wall_s=wall, useful_s=useful,
                   effective_time_ratio=useful / wall if wall > 0 else None, failures=len(t.failures),
                   failure_kinds=t.failures, time_to_detect_s=t.detect_s, time_to_recover_s=t.recover_s,
                   recovery_kinds=t.kinds,
                   evicted=self.pool.evicted)
        if t.failures:
            print(f"mshpc: supervisor: {len(t.failures)} failure(s) ({', '.join(t.failures)}); detected in "
                  f"{_secs(t.detect_s)}; recovered in {_secs(t.recover_s) or '-'}; effective training time "
                  f"{useful / wall:.0%} of {wall:.1f} s", file=sys.stderr)
        return code


def check_pause(cost_s: float) -> float:
    """The pause after a pass of the supervisor's loop that cost `cost_s` of this thread's CPU time:
    enough to keep checks to CHECK_SHARE of it, at most MAX_PAUSE_S. CPU time, not wall time: a
    pass that waited (an event's write, a rank's fork, a loaded host's scheduler) holds no GIL
    from the monitor meanwhile. Paced by wall time without a bound, a pass of 0.8 s would pause the
    loop 7.2 s; on a loaded 2-core host a rank's SIGKILL was once seen 7.4 s late."""
    return min(max(0.0, cost_s) * (1 / CHECK_SHARE - 1), MAX_PAUSE_S)


def useful_step_seconds(metrics: Path, trained_from: int | None) -> float:
    """Seconds of the steps that count: those this run trained, after `trained_from` (the lowest
    step its attempts resumed at; None: it trained none), not an earlier run's in the same folder.
    Only the steps of the final history count (`read_metrics`: a resume drops the ones trained
    after the checkpoint); a record stands for the steps since the previous one
    (run.log_interval_steps)."""
    if trained_from is None:
        return 0.0
    total, previous = 0.0, trained_from
    for record in read_metrics(metrics):
        if record["step"] > trained_from:
            total += (record["step"] - previous) * (record.get("step_time_s") or 0.0)
            previous = record["step"]
    return total


def _secs(values: list[float]) -> str:
    return ", ".join(f"{v:.1f} s" for v in values)


# ---------------------------------------------------------------- local ranks on slots


def slot_hosts(nproc: int, *, ranks_per_slot: int, spare_nodes: int) -> tuple[list[str], int]:
    """Local "nodes": slot0, slot1, ... of supervisor.ranks_per_slot ranks each, plus the spares;
    returns them and how many the ranks need."""
    from mshpc.errors import ConfigError

    if nproc % ranks_per_slot:
        raise ConfigError(f"supervisor.ranks_per_slot={ranks_per_slot} does not divide the {nproc} local ranks")
    needed = nproc // ranks_per_slot
    return [f"slot{i}" for i in range(needed + spare_nodes)], needed


def supervise_local(argv: list[str], nproc: int, *, supervisor: SupervisorConfig, spare_nodes: int,
                    run_dir: Path, checkpoints: Path, recovery: RecoveryConfig | None = None,
                    parallel: ParallelConfig | None = None) -> int:
    """`mshpc train --nproc N`: N local ranks under the supervisor; returns the exit code."""
    from mshpc.launch.local import LocalRanks

    per = supervisor.ranks_per_slot
    hosts, needed = slot_hosts(nproc, ranks_per_slot=per, spare_nodes=spare_nodes)

    def start(attempt: int, active: list[str], env: dict[str, str]) -> Ranks:
        # the first rank of each slot starts the slot's heartbeat relay (launch/node_relay.py)
        return _LocalAttempt(LocalRanks(argv, [{**env, "MSHPC_NODE": active[r // per],
                                                "MSHPC_NODE_RELAY_START": "1" if r % per == 0 else "0"}
                                               for r in range(nproc)]))

    sup = Supervisor(nproc, NodePool(hosts, needed, supervisor.evict_after), start, "127.0.0.1",
                     supervisor=supervisor, spare_nodes=spare_nodes, run_dir=run_dir, checkpoints=checkpoints,
                     recovery=recovery, parallel=parallel)
    with stop_signals_to(sup.request_stop):
        return sup.run()


class _LocalAttempt:
    def __init__(self, ranks: Any) -> None:
        self.ranks = ranks

    def update(self, states: dict[int, RankState]) -> None:
        for rp in self.ranks.ranks:
            if rp.exited_wall is not None and states[rp.rank].exited_at is None:
                s = states[rp.rank]
                s.exit_code, s.exited_at = rp.proc.returncode, rp.exited_wall
                s.exit_detail = self.ranks.failure_of(rp).describe()

    def request_stop(self) -> None:
        self.ranks.signal_all(STOP_REQUEST_SIGNAL)

    def stop(self, grace_s: float) -> list[int]:
        return self.ranks.stop(grace_s)

    def kill(self, rank: int) -> None:
        self.ranks.kill(rank)

    def replace(self, rank: int, env: dict[str, str]) -> None:
        self.ranks.replace(rank, env)

    def wake_on_exit(self, event: threading.Event) -> None:
        self.ranks.wake = event
