"""The local launcher: start N ranks on this machine, wait, and stop them all if one fails.

Ranks get torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), so the
same training entry point serves torchrun, srun, mpiexec and this launcher. Every rank is forked
by one fork server (mshpc/launch/fork_server.py) that has imported torch and the train loop once,
the first ranks and, for a recovery in place, each replacement, within milliseconds.
"""

from __future__ import annotations

import collections
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mshpc.launch.forked import ForkServer
from mshpc.launch.ports import free_port

STOP_GRACE_S = 5.0  # SIGTERM first, so ranks can flush logs; SIGKILL after this
TAIL_LINES = 20


class Process(Protocol):
    """What the launcher uses of a process: subprocess.Popen's, or a forked rank's (forked.py)."""

    @property
    def pid(self) -> int | None: ...  # None: not forked yet
    @property
    def returncode(self) -> int | None: ...
    @property
    def stderr(self) -> Any: ...

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, signum: int) -> None: ...
    def kill(self) -> None: ...


@dataclass
class RankProcess:
    rank: int
    proc: Process
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    exited_at: float | None = None
    exited_wall: float | None = None  # time.time(), comparable with the ranks' own reports


@dataclass(frozen=True)
class RankFailure:
    rank: int
    returncode: int
    last_lines: tuple[str, ...]

    @property
    def exit_code(self) -> int:
        """The launcher's own exit code: the rank's, or 128+N for a signal, as a shell does."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def describe(self) -> str:
        if self.returncode < 0:
            # A signal leaves no last words: whatever the rank printed last is not the reason.
            return f"rank {self.rank} was killed by {signal.Signals(-self.returncode).name}"
        how = f"exited with code {self.returncode}"
        why = next((line for line in reversed(self.last_lines) if line.strip()), "")
        # torch.distributed prefixes uncaught tracebacks with "[rankN]: "; we say the rank already.
        why = re.sub(r"^\[rank\d+\]:\s*", "", why.strip())
        return f"rank {self.rank} {how}" + (f": {why}" if why else "")


FORK_SERVER = -1  # the fork server's stderr is pumped as a rank's is, under this number
CLEAR_LINE = "\r\033[K"  # back to the line's start, then erase it (ECMA-48 EL), as progress.py draws


def _pump(rp: RankProcess) -> None:
    """Copy a rank's stderr to ours with a rank prefix, keeping the last lines for the report.
    On a terminal each line first erases the current one: rank 0's progress bar reaches the
    terminal straight (stdout is inherited) while its log lines come through here later, so the
    bar may have been redrawn after the rank wiped it; the next step draws it again."""
    assert rp.proc.stderr is not None
    erase = CLEAR_LINE if sys.stderr.isatty() else ""
    for raw in rp.proc.stderr:
        line = raw.decode(errors="replace").rstrip("\n")
        rp.tail.append(line)
        sys.stderr.write(f"{erase}[{'fork server' if rp.rank == FORK_SERVER else f'rank {rp.rank}'}] {line}\n")
        sys.stderr.flush()


def _watch(rp: RankProcess, exited: Callable[[], None]) -> None:
    rp.proc.wait()
    rp.exited_at = time.monotonic()
    rp.exited_wall = time.time()
    exited()


def _rank_env(rank: int, nproc: int, port: int, extra_env: dict[str, str]) -> dict[str, str]:
    """A rank's own variables; `extra_env`'s MASTER_PORT wins (a generation's store)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "MSHPC_BOOTSTRAP": "env", **extra_env}


def stop_all(procs: Sequence[Process], grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM every live process, SIGKILL those still alive after `grace_s` (a hung one);
    returns the indices of the processes that needed SIGKILL. SIGCONT follows SIGTERM, as
    systemd does: a stopped process (SIGSTOP, Ctrl-Z) acts on it at once instead of holding it
    pending until the SIGKILL, which made every restart after a frozen rank wait the grace."""
    alive = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
    for _, p in alive:
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    killed = []
    for i, p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed.append(i)
    return killed


def _first_failure(ranks: list[RankProcess]) -> RankProcess | None:
    """The earliest rank to exit non-zero: later failures are usually its echo
    (peers see a closed connection)."""
    failed = [r for r in ranks if r.exited_at is not None and r.proc.returncode != 0]
    return min(failed, key=lambda r: r.exited_at or 0.0, default=None)


class LocalRanks:
    """`python -m mshpc ARGV` as N ranks on this machine, forked by one fork server, with their
    stderr prefixed and kept. Started from the thread that stops it: the server dies with it."""

    def __init__(self, argv: Sequence[str], rank_env: Sequence[dict[str, str]],
                 wake: threading.Event | None = None) -> None:
        self.argv, self.nproc, self.port = list(argv), len(rank_env), free_port()
        # what every rank of the attempt shares (the supervisor's address and token...)
        self.base_env = {k: v for k, v in (rank_env[0] if rank_env else {}).items()
                         if all(env.get(k) == v for env in rank_env)}
        self.changed = threading.Event()
        self.wake = wake  # also set on an exit: the supervisor's loop waits on it
        self._threads: list[threading.Thread] = []
        self.server = ForkServer(argv, self.base_env)
        # its words (an import that failed) go to stderr as a rank's do, and end the ranks it was to fork
        self.server_out = RankProcess(FORK_SERVER, self.server.proc)
        self._server_pump = threading.Thread(target=_pump, args=(self.server_out,), daemon=True)
        self._server_pump.start()
        self._threads.append(self._server_pump)
        self.ranks = [self._fork(r, env) for r, env in enumerate(rank_env)]

    def _fork(self, rank: int, env: dict[str, str]) -> RankProcess:
        """Fork `rank` with `env` on top of the attempt's; pump its stderr and watch for its exit."""
        rp = RankProcess(rank, self.server.fork({**self.base_env, **_rank_env(rank, self.nproc, self.port, env)}))
        for f, a in ((_pump, (rp,)), (_watch, (rp, self._exited))):
            thread = threading.Thread(target=f, args=a, daemon=True)
            thread.start()
            self._threads.append(thread)
        return rp

    def _exited(self) -> None:
        self.changed.set()
        if self.wake is not None:
            self.wake.set()

    # ---------------------------------------------------------------- recovery in place

    def kill(self, rank: int) -> None:
        """SIGKILL `rank` (a frozen process too), and wait for its end: its sockets close, so
        its peers' collectives fail instead of waiting on it."""
        proc = self.ranks[rank].proc
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def replace(self, rank: int, env: dict[str, str]) -> None:
        """Run `rank` anew, forked with `env` on top of the attempt's."""
        self.ranks[rank] = self._fork(rank, env)

    def all_exited(self) -> bool:
        return all(r.exited_at is not None for r in self.ranks)

    def first_failure(self) -> RankFailure | None:
        failed = _first_failure(self.ranks)
        return None if failed is None else self.failure_of(failed)

    def failure_of(self, rp: RankProcess) -> RankFailure:
        """How `rp` ended; a rank never forked has no words: the server's say why (an import that failed)."""
        if rp.proc.pid is None:  # the server has ended: its last lines are on their way
            self._server_pump.join(timeout=STOP_GRACE_S)
        said = rp.tail if rp.proc.pid is not None else self.server_out.tail
        assert rp.proc.returncode is not None
        return RankFailure(rank=rp.rank, returncode=rp.proc.returncode, last_lines=tuple(said))

    def signal_all(self, signum: int) -> None:
        """Send `signum` to every rank still running."""
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.send_signal(signum)

    def stop(self, grace_s: float = STOP_GRACE_S) -> list[int]:
        """Stop every rank (see `stop_all`), then the fork server; returns the ranks that needed
        SIGKILL. A server that has not forked them all yet is still importing: it is ended first,
        and with it what it forked, rather than waited for."""
        if self.server.unforked():
            self.server.close()
        killed = stop_all([r.proc for r in self.ranks], grace_s)
        self.server.close()
        for t in self._threads:
            t.join(timeout=STOP_GRACE_S)
        return killed


def launch_local(
    argv: Sequence[str], nproc: int, extra_env: dict[str, str] | None = None
) -> RankFailure | None:
    """Run `python -m mshpc ARGV` as `nproc` ranks; return the first failure, or None."""
    ranks = LocalRanks(argv, [dict(extra_env or {}) for _ in range(nproc)])
    try:
        while not ranks.all_exited() and ranks.first_failure() is None:
            ranks.changed.wait(timeout=1.0)
            ranks.changed.clear()
    finally:
        # Also on KeyboardInterrupt: never leave ranks orphaned, blocked in a collective.
        ranks.stop()
    return ranks.first_failure()
