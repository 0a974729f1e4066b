"""The loggers' own process: rank 0 starts it, and TensorBoard and W&B run there, not in a rank.

Why a process and not a thread: W&B initialised inside rank 0 made that rank's loop thread take
more CPU per step, with no row logged at all (benchmarks/loggers_eval.py; docs/benchmarks/loggers_eval_cpu2_2026-12-04.md), and a
rank's GIL is the loop's. Here the loop's whole cost is one non-blocking pipe write per row.

Protocol, JSON lines both ways (nothing pickled). Rows pipe, parent -> child: first
{"config", "run_dir", "start_step"}, then {"write": row} or {"event": record, "step": s}; its end
(EOF) asks the child to flush, close its loggers and exit. Status pipe, child -> parent: {"ready"}
or {"error", "message"} at start-up; {"closed"} or {"error", "message"} at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from mshpc import errors
from mshpc.config import RunConfig, from_dict
from mshpc.events import append_event

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # wandb.init (its service process, a 2 s network probe) on a loaded node
CLOSE_TIMEOUT_S = 120.0  # the child's last rows, then W&B writing its run's last records
PIPE_BYTES = 1 << 20  # about 3,000 rows in flight before the loop keeps them itself
PENDING_LIMIT_BYTES = 8 << 20  # past this the loop waits for the child rather than lose rows
LOST_EVENT = "logger_lost"


class LoggerProcess:
    """Rank 0's side: the Logger interface, each call one JSON line written without blocking (what
    the pipe cannot take yet waits in `pending` for the next call). If the child dies, training goes
    on: one warning, one `logger_lost` event, and metrics.jsonl still has every row."""

    def __init__(self, proc: subprocess.Popen[bytes], rows_fd: int, status_fd: int, run_dir: Path) -> None:
        self.proc, self.rows_fd, self.status_fd, self.run_dir = proc, rows_fd, status_fd, run_dir
        self.pending = b""
        self.lost = False

    def write(self, row: dict[str, Any]) -> None:
        self._send({"write": row})

    def event(self, record: dict[str, Any], step: int) -> None:
        self._send({"event": record, "step": step})

    def _send(self, message: dict[str, Any]) -> None:
        if self.lost:
            return
        if self.proc.poll() is not None:  # one waitpid: a dead child's pipe may still take bytes
            self._lose(f"exited with code {self.proc.returncode}")
            return
        self.pending += (json.dumps(message, default=str) + "\n").encode()
        self._flush(None if len(self.pending) < PENDING_LIMIT_BYTES else time.monotonic() + CLOSE_TIMEOUT_S)

    def _flush(self, deadline: float | None) -> bool:
        """Write what the pipe takes now; with a deadline, wait until all is written or then."""
        while self.pending:
            try:
                self.pending = self.pending[os.write(self.rows_fd, self.pending):]
            except BlockingIOError:
                if deadline is None:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    self._lose("stopped reading its rows" if left <= 0 else f"exited with code {self.proc.returncode}")
                    return False
                select.select([], [self.rows_fd], [], min(left, 1.0))
            except BrokenPipeError:
                self._lose(f"exited with code {self.proc.wait()}")
                return False
        return True

    def _lose(self, why: str) -> None:
        """Once: stop writing to the child, say why (with its own last words, if it sent any)."""
        self.lost, self.pending = True, b""
        said = read_status(self.status_fd, 0.0)
        if said and "message" in said:
            why = f"{why}: {said['error']}: {said['message']}"
        log.warning("the logger process %s; training goes on without TensorBoard and W&B "
                    "(metrics.jsonl keeps every row)", why)
        append_event(self.run_dir, LOST_EVENT, why=why)
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        """Hand on the last rows and wait until the child has closed its loggers (a W&B run is
        complete on disk then). Never raises: training is over, and what failed is warned."""
        try:
            if not self.lost and self._flush(time.monotonic() + CLOSE_TIMEOUT_S):
                os.close(self.rows_fd)  # EOF: the child's signal to finish
                self.rows_fd = -1
                said = read_status(self.status_fd, CLOSE_TIMEOUT_S)
                if said is None or "closed" not in said:
                    self._lose("did not close its loggers" if said is None else
                               f"failed closing its loggers: {said['error']}: {said['message']}")
            try:
                self.proc.wait(timeout=CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # its loggers are closed: nothing is lost by ending it
                self.proc.kill()
                self.proc.wait()
        finally:
            for fd in (self.rows_fd, self.status_fd):
                if fd >= 0:
                    os.close(fd)


def read_status(fd: int, timeout_s: float) -> dict[str, Any] | None:
    """The child's next status line, or None if none comes within `timeout_s` or it closed."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while not data.endswith(b"\n"):
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
    status: dict[str, Any] = json.loads(data.splitlines()[0])
    return status


def start_logger_process(run_dir: Path, start_step: int, *, run: RunConfig, config_record: dict[str, Any],
                         timeout_s: float = START_TIMEOUT_S) -> LoggerProcess:
    """Start the child and wait until its loggers are built; one that cannot start raises its
    one-line MshpcError here, before the first step. `config_record`: the resolved config as
    plain data (the child reads `run` from it, and W&B records it)."""
    rows_r, rows_w = os.pipe()
    status_r, status_w = os.pipe()
    with contextlib.suppress(OSError):  # Linux only; the default 64 KiB pipe also works
        fcntl.fcntl(rows_w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    # not in a session of its own: Slurm's and the supervisor's signals reach it (it outlives
    # them until rank 0 closes the pipe), and the nice value counts against the ranks'
    proc = subprocess.Popen([sys.executable, "-m", "mshpc.loggers.logger_process", str(rows_r), str(status_w)],
                            pass_fds=(rows_r, status_w))
    os.close(rows_r)
    os.close(status_w)
    first = {"config": config_record, "run_dir": str(run_dir), "start_step": start_step}
    os.write(rows_w, (json.dumps(first) + "\n").encode())  # a few KiB: the empty pipe takes it
    os.set_blocking(rows_w, False)
    status = read_status(status_r, timeout_s)
    if status is not None and "ready" in status:
        return LoggerProcess(proc, rows_w, status_r, run_dir)
    proc.kill()
    code = proc.wait()
    os.close(rows_w)
    os.close(status_r)
    if status is None:
        raise errors.RunEnvironmentError(
            f"run.loggers {list(run.loggers)}: the logger process did not start within {timeout_s:g} s"
            if code == -signal.SIGKILL else
            f"run.loggers {list(run.loggers)}: the logger process exited with code {code} before it "
            "was ready (its output is above)")
    raise as_error(status)


def as_error(status: dict[str, Any]) -> errors.MshpcError:
    """The child's error as the parent's: the same MshpcError class and line where it was one."""
    kind = getattr(errors, status["error"], None)
    if isinstance(kind, type) and issubclass(kind, errors.MshpcError):
        return kind(status["message"])
    return errors.RunEnvironmentError(f"run.loggers could not start: {status['error']}: {status['message']}")


# -- the child -----------------------------------------------------------------------------------

def build_named(run_dir: Path, start_step: int, *, run: RunConfig, config_record: dict[str, Any]) -> list[Any]:
    """The loggers `run.loggers` names besides jsonl, built in order; on failure the ones already
    built are closed and the error raised."""
    built: list[Any] = []
    try:
        for name in run.loggers:
            if name == "tensorboard":
                from mshpc.loggers.tensorboard_log import TensorBoardLogger

                built.append(TensorBoardLogger(run_dir / "tb"))
            elif name == "wandb":
                from mshpc.loggers.wandb_log import WandbLogger

                built.append(WandbLogger(run_dir, start_step, run=run, config_record=config_record))
    except BaseException:
        for logger in built:
            logger.close()
        raise
    return built


def tasks(pid: int) -> list[int]:
    """Every thread of `pid` and of the processes it started, theirs too (Linux's /proc)."""
    found = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in list(found):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
            for child in f.read().split():
                with contextlib.suppress(OSError):
                    found += tasks(int(child))
    return found


def lower_priority(increment: int) -> None:
    """Raise by `increment` the nice value of this process and what it started (W&B's service).
    Linux keeps one per thread, so each thread is lowered: TensorBoard's writer, W&B's sender."""
    if increment == 0:
        return
    if sys.platform != "linux":
        os.nice(increment)  # elsewhere the value is the process's
        return
    for tid in tasks(os.getpid()):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))


def report(fd: int, **status: Any) -> None:
    with contextlib.suppress(BrokenPipeError):  # rank 0 is gone: there is no one left to tell
        os.write(fd, (json.dumps(status) + "\n").encode())


def report_error(fd: int, exc: BaseException) -> None:
    if not isinstance(exc, errors.MshpcError):
        traceback.print_exc()  # not a user's error: the whole story, on the rank's stderr
    report(fd, error=type(exc).__name__, message=(str(exc).splitlines() or [""])[0])


def serve(rows_fd: int, status_fd: int) -> int:
    """The child: build the loggers, then hand each line to each of them, in order, until EOF."""
    for fd in (rows_fd, status_fd):
        os.set_inheritable(fd, False)  # W&B's service must not hold the pipes open past this process
    # Python handlers, not SIG_IGN: ignored signals would stay ignored in W&B's service after exec.
    # The rank decides when the run ends (a preemption still saves and logs its last rows).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda *_: None)
    with os.fdopen(rows_fd, "rb") as rows:
        first = json.loads(rows.readline())
        run = from_dict(first["config"]).run  # validated again: the pipe's data is checked like a file's
        try:  # at the rank's priority: a niced start-up on a busy node took minutes
            loggers = build_named(Path(first["run_dir"]), first["start_step"], run=run, config_record=first["config"])
        except BaseException as exc:
            report_error(status_fd, exc)
            return 1
        lower_priority(run.logger_nice_increment)
        report(status_fd, ready=True)
        try:
            for line in rows:
                message = json.loads(line)
                for logger in loggers:
                    if "write" in message:
                        logger.write(message["write"])
                    else:
                        logger.event(message["event"], message["step"])
            for logger in loggers:
                logger.close()
        except BaseException as exc:
            report_error(status_fd, exc)
            return 1
    report(status_fd, closed=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="mshpc: %(message)s")
    sys.exit(serve(int(sys.argv[1]), int(sys.argv[2])))
