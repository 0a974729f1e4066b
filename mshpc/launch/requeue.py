"""Pre-timeout checkpoint and requeue: the signal watcher the train loop polls, `scontrol requeue`,
and the guards that keep a requeue loop from spinning forever.

A job's exit code says what should happen next (sbatch/train.sbatch and `mshpc.submit` keep to it):
  0                   finished; the run's FINISHED marker names the job, so a requeue of it does nothing
  2 (USER_ERROR_EXIT) a user error (any MshpcError: config, data, checkpoint); retrying cannot help
  128+N               stopped by signal N after a stop checkpoint (N = the preempt signal: requeued)
  anything else       a crash: requeued while slurm.max_failures_without_progress allows

`python -m mshpc.launch.requeue check|after RC CONFIG [--set k=v ...]` is the batch script's side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn

from mshpc.checkpoint.paths import checkpoint_root, latest_step
from mshpc.config import SlurmConfig, load_config
from mshpc.errors import USER_ERROR_EXIT, MshpcError, print_error, writing_to
from mshpc.launch.env import LaunchEnv, SlurmEnv, read_launch_env
from mshpc.regular_files import read_regular, write_own
from mshpc.run_dir import run_path

log = logging.getLogger(__name__)

FINISHED_FILE = "FINISHED"
STATE_FILE = "requeue.json"
STATE_MAX_BYTES = 64 * 1024  # the guard state and the FINISHED marker are a line each
_STOP, _REQUEUE = 1, 2  # what a signal asks for; the strongest one received wins
# What mshpc's supervisor sends its ranks to ask for a stop checkpoint (and what a rank sends
# itself when its supervisor is gone). Not SIGTERM: a local supervisor stops failed attempts' ranks
# with SIGTERM, at once, and a survivor blocked in a collective must not wait for a step boundary.
STOP_REQUEST_SIGNAL = signal.SIGHUP


@dataclass(frozen=True)
class StopRequest:
    """What the ranks agreed on at a step boundary: checkpoint, then stop (and requeue?)."""

    signum: int
    requeue: bool

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # as a shell reports a death by this signal


class JobStopped(SystemExit):
    """Raised on every rank after the stop checkpoint. A SystemExit, not an MshpcError: the CLI
    must not turn it into the do-not-requeue code, and submitit must not record a result."""


class PreemptionWatcher:
    """Signal handlers that only set a flag; the train loop polls `should_stop` at step boundaries."""

    def __init__(self, env: LaunchEnv, wants: dict[int, int], *, slurm: SlurmConfig, run_dir: Path,
                 checkpoints: Path) -> None:
        self.env, self.wants = env, wants
        self.slurm, self.run_dir, self.checkpoints = slurm, run_dir, checkpoints
        self.received = 0
        self.signals: list[str] = []  # the names of the signals received here, for the last line
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and "SIGINT" in self.signals:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, as without a handler
        self.received = max(self.received, self.wants[signum])
        self.signals.append(signal.Signals(signum).name)

    def install(self) -> None:
        for signum in self.wants:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> PreemptionWatcher:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def should_stop(self, group: Any = None) -> StopRequest | None:
        """Collective over `group` (the world when None): whether any rank was signalled, and how."""
        # imported here: the batch script's guard (`check`/`after`) runs without torch
        import torch
        import torch.distributed as dist

        from mshpc.parallel import comm

        flag = torch.tensor([self.received], device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
        comm.all_reduce(flag, group=group, op=dist.ReduceOp.MAX)
        level = int(flag.item())
        if level == 0:
            return None
        if level == _REQUEUE:
            return StopRequest(signal.Signals["SIG" + self.slurm.preempt_signal].value, requeue=True)
        return StopRequest(signal.SIGTERM.value, requeue=False)

    def stop(self, request: StopRequest, rank: int) -> NoReturn:
        """Collective over the world, after the stop checkpoint is committed: rank 0 requeues the
        job when asked (and the guard allows), the others wait for it, then every rank exits."""
        if rank == 0:
            got = ", ".join(dict.fromkeys(self.signals)) or "another rank's"
            log.warning("stopping after a checkpoint (%s signal)", got)
            if request.requeue:
                requeue_guarded(self.env, slurm=self.slurm, run_dir=self.run_dir, checkpoints=self.checkpoints)
        from mshpc.parallel import comm

        comm.barrier()  # nobody exits first: srun --kill-on-bad-exit would kill rank 0 mid-requeue
        raise JobStopped(request.exit_code)


def watch_signals(env: LaunchEnv, *, slurm: SlurmConfig, run_dir: Path, checkpoints: Path) -> PreemptionWatcher:
    """Install the handlers: the preempt signal asks for checkpoint + requeue; under MPI also USR1
    (MPICH's mpiexec forwards no other; the template translates); under Slurm, SIGTERM (scancel,
    the time limit) asks for checkpoint + stop while Slurm's KillWait lasts; under mshpc's
    supervisor, STOP_REQUEST_SIGNAL does (the supervisor was told to stop, or is gone); SIGINT
    (Ctrl-C) does everywhere, and a second SIGINT stops at once. A requeue is guarded by `slurm`'s
    budget, counted in `run_dir` against the newest checkpoint in `checkpoints`."""
    wants = {signal.Signals["SIG" + slurm.preempt_signal].value: _REQUEUE}
    if env.launcher == "mpi":
        wants[signal.SIGUSR1.value] = _REQUEUE
    if env.slurm is not None:
        wants[signal.SIGTERM.value] = _STOP
    if env.supervisor is not None:
        wants.setdefault(STOP_REQUEST_SIGNAL.value, _STOP)
    wants.setdefault(signal.SIGINT.value, _STOP)
    watcher = PreemptionWatcher(env, wants, slurm=slurm, run_dir=run_dir, checkpoints=checkpoints)
    watcher.install()
    return watcher


# ---------------------------------------------------------------- requeue and its guards


def job_key(slurm: SlurmEnv) -> str:
    """What `scontrol` calls this job: ARRAYJOB_TASK for an array task, else the job id."""
    if slurm.array_job_id is not None and slurm.array_task_id is not None:
        return f"{slurm.array_job_id}_{slurm.array_task_id}"
    return str(slurm.job_id)


def requeue(env: LaunchEnv, hold: bool = False) -> bool:
    """`scontrol requeue` this job (rank 0 only; `hold`: requeuehold, for a change before its
    release); False, logged, when that is not possible."""
    if env.slurm is None:
        log.warning("not running under Slurm: nothing to requeue")
        return False
    key = job_key(env.slurm)
    verb = "requeuehold" if hold else "requeue"
    try:
        # its own session: the preempt signals a launcher sends to the rank's process group
        # (Hydra does; several copies may come) must not kill scontrol half-way
        out = subprocess.run(["scontrol", verb, key], capture_output=True, text=True, timeout=60,
                             start_new_session=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("scontrol %s %s failed: %s", verb, key, exc)
        return False
    if out.returncode != 0:
        log.error("scontrol %s %s failed: %s", verb, key, out.stderr.strip())
        return False
    log.warning("requeued Slurm job %s", key)
    return True


@dataclass(frozen=True)
class GuardState:
    """requeue.json in the run directory: the requeue history of one job."""

    job: str
    checkpoint_step: int | None  # latest checkpoint at the last failure
    failures_without_progress: int
    requeued_restart: int | None = None  # SLURM_RESTART_COUNT of the run whose rank 0 requeued


def account(prior: GuardState | None, job: str, checkpoint_step: int | None) -> GuardState:
    """The state after one more failure (or preemption) of `job`, given its latest checkpoint."""
    if prior is None or prior.job != job:  # a new submission starts a fresh budget
        prior = GuardState(job, None, 0)
    progress = checkpoint_step is not None and (
        prior.checkpoint_step is None or checkpoint_step > prior.checkpoint_step)
    return GuardState(job, checkpoint_step, 0 if progress else prior.failures_without_progress + 1)


def read_state(run_dir: Path) -> GuardState | None:
    path = run_dir / STATE_FILE
    return GuardState(**json.loads(read_regular(path, STATE_MAX_BYTES))) if path.is_file() else None


def write_state(run_dir: Path, state: GuardState) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{STATE_FILE}.tmp"
    with writing_to(tmp):
        write_own(tmp, json.dumps(dataclasses.asdict(state)))
    tmp.replace(run_dir / STATE_FILE)


def latest_checkpoint_step(checkpoints: Path) -> int | None:
    """The step `latest` names under the checkpoint root `checkpoints`; None before any save."""
    # only the torch-free paths module: the supervisor prints its last line with this, and
    # importing torch for it took seconds on a loaded machine
    return latest_step(checkpoints)


def requeue_guarded(env: LaunchEnv, *, slurm: SlurmConfig, run_dir: Path, checkpoints: Path,
                    hold: bool = False) -> bool:
    """Requeue unless the job has failed too often without a newer checkpoint (rank 0 or the
    batch script); the history is saved first, as the requeue ends this process."""
    if env.slurm is None:
        return requeue(env, hold)
    key = job_key(env.slurm)
    state = account(read_state(run_dir), key, latest_checkpoint_step(checkpoints))
    budget = slurm.max_failures_without_progress
    if state.failures_without_progress > budget:
        write_state(run_dir, state)
        log.error("not requeued: %d consecutive failures without a newer checkpoint "
                  "(slurm.max_failures_without_progress=%d)", state.failures_without_progress, budget)
        return False
    write_state(run_dir, dataclasses.replace(state, requeued_restart=env.slurm.restart_count))
    if requeue(env, hold):
        return True
    write_state(run_dir, state)
    return False


def mark_finished(run_dir: Path, job: str, step: int | None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"job": job, "step": step, "finished_unix": time.time()}
    with writing_to(run_dir / FINISHED_FILE):
        write_own(run_dir / FINISHED_FILE, json.dumps(record) + "\n")


def finished_by(run_dir: Path, job: str) -> bool:
    """Whether this same job already finished this run (a later submission trains anew)."""
    path = run_dir / FINISHED_FILE
    return path.is_file() and json.loads(read_regular(path, STATE_MAX_BYTES)).get("job") == job


# ---------------------------------------------------------------- the batch script's side


def after_exit(rc: int, env: LaunchEnv, *, slurm: SlurmConfig, run_dir: Path, checkpoints: Path) -> None:
    """What the batch script does once the ranks have exited with `rc`."""
    if env.slurm is None:
        return
    key = job_key(env.slurm)
    state = read_state(run_dir)
    if rc == 0:
        mark_finished(run_dir, key, latest_checkpoint_step(checkpoints))
    elif rc == USER_ERROR_EXIT:
        log.error("not requeued: exit code %d is a user error that a retry cannot fix", rc)
    elif state is not None and state.job == key and state.requeued_restart == env.slurm.restart_count:
        log.info("rank 0 requeued the job already")
    else:
        log.warning("the ranks exited with code %d", rc)
        requeue_guarded(env, slurm=slurm, run_dir=run_dir, checkpoints=checkpoints)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mshpc.launch.requeue",
                                description="The requeue guards of sbatch/train.sbatch.")
    sub = p.add_subparsers(dest="what", required=True)
    check = sub.add_parser("check", help="validate the config; print 'finished' if this job already finished it, else 'run'")
    after = sub.add_parser("after", help="after the ranks exited with RC: mark finished, or requeue within the budget")
    after.add_argument("rc", type=int)
    for s in (check, after):
        s.add_argument("config")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


def run_batch_helper(body: Callable[[], int]) -> int:
    """What every batch-script helper does around its `body` (which loads CONFIG --set ... and
    the launch environment): the log format, and a user error as one line and USER_ERROR_EXIT."""
    logging.basicConfig(level=logging.INFO, format="mshpc: %(message)s")
    try:
        return body()
    except MshpcError as exc:
        print_error(exc)
        return USER_ERROR_EXIT


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)

    def guard() -> int:
        cfg, env = load_config(args.config, args.set), read_launch_env()
        run_dir = run_path(cfg.run)
        if args.what == "check":
            done = env.slurm is not None and finished_by(run_dir, job_key(env.slurm))
            print("finished" if done else "run")
            return 0
        after_exit(args.rc, env, slurm=cfg.slurm, run_dir=run_dir, checkpoints=checkpoint_root(cfg.checkpoint, run_dir))
        return int(args.rc)

    return run_batch_helper(guard)


if __name__ == "__main__":
    sys.exit(main())
