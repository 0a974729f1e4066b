"""The fork server: one process per node and attempt that imports torch and the train loop once,
then forks every local rank from that state, the first ones and each replacement of a recovery in
place (mshpc/launch/in_place.py). A rank's start-up imports 2.5-3 CPU-s, more than a whole
recovery may take; forked, a replacement starts in milliseconds at any moment of the run, also in
a rerun's first seconds and for a second fault right after a first (ByteRobust's warm standbys do
the same job with one idle process per expected fault; Android's zygote is this design).

    python -m mshpc.launch.fork_server ARGV...     (ARGV: the ranks' own `mshpc` arguments)

Its launcher (mshpc/launch/forked.py) holds the other end of its socket and asks for each rank
(mshpc/launch/fork_protocol.py); the server is the ranks' parent, reaps them and reports their
ends. End of input: it exits.

A fork is safe only from a process with one thread and no CUDA context; the server checks both
after its imports and refuses to serve otherwise (its words then end every rank it was asked for).
It ignores the signals that ask a job to stop, which its ranks act on: it ends when its launcher
closes its socket or dies.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import NoReturn

from mshpc.launch.fork_protocol import FD_ENV, MESSAGE_MAX_BYTES, Request, read_request
from mshpc.launch.orphan_guard import die_with_parent

# What a scheduler or a person sends a job's processes to ask for a stop or a checkpoint (scancel
# and the time limit signal every process of a job step, this one too): its ranks act on them,
# the server holds nothing to save, and its end would take its ranks with it (their death signal)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def ignore_stop_signals() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def restore_stop_signals() -> None:
    """What a fresh Python process has: KeyboardInterrupt on SIGINT, the default for the others."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


def unsafe_to_fork() -> str:
    """Why this process may not fork ranks ("" when it may): a thread other than this one would be
    missing in the child with whatever lock it held, and a CUDA context cannot cross a fork."""
    import torch

    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads after the imports (a fork copies only one)"
    if torch.cuda.is_initialized():
        return "CUDA was initialized by the imports (a forked child could not use it)"
    return ""


@dataclass
class Child:
    """What a forked child takes from the server: its variables and its stderr."""

    env: dict[str, str]
    stderr_fd: int


def _send(control: socket.socket, message: dict[str, int]) -> None:
    control.send(json.dumps(message).encode())


def _reap(control: socket.socket) -> None:
    """Report every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(control, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(control: socket.socket, request: Request, stderr_fd: int, wakeup: tuple[int, int],
          sel: selectors.BaseSelector) -> Child | None:
    """Fork one rank: in the child, drop what is the server's and return what the rank needs; in
    the server, tell the launcher the child's PID and return None."""
    sys.stdout.flush()  # nothing of the server's may be written twice, or by the child
    sys.stderr.flush()
    guard = die_with_parent()
    pid = os.fork()
    if pid:
        os.close(stderr_fd)
        _send(control, {"forked": request.number, "pid": pid})
        return None
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    restore_stop_signals()
    sel.close()
    for fd in wakeup:
        os.close(fd)
    control.close()  # the launcher sees the server's end when the server ends, not its last rank
    os.setsid()  # as a rank started by Popen(start_new_session=True): the terminal's signals are the launcher's
    if guard is not None:
        guard()  # dies with the server, which dies with its launcher
    return Child(request.env, stderr_fd)


def serve(control: socket.socket) -> Child | None:
    """Fork a rank per request until the launcher closes its end (None); returns, in a child only,
    what that child is to run as."""
    wakeup = os.pipe()
    os.set_blocking(wakeup[1], False)
    signal.set_wakeup_fd(wakeup[1])  # a child's end wakes the loop below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    sel.register(wakeup[0], selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is not control:
                os.read(wakeup[0], 4096)
                _reap(control)
                continue
            data, fds, flags, _ = socket.recv_fds(control, MESSAGE_MAX_BYTES, 1)
            if not data:
                return None
            if flags & socket.MSG_TRUNC or len(fds) != 1:
                raise ValueError("a fork request longer than a message, or without its one descriptor")
            child = _fork(control, read_request(data), fds[0], wakeup, sel)
            if child is not None:
                return child


def main(argv: list[str]) -> NoReturn:
    ignore_stop_signals()
    control = socket.socket(fileno=int(os.environ.pop(FD_ENV)))
    # the imports a rank's start-up would pay, paid once: the CLI, torch, the train loop, and
    # DALI, which a loader (data.loader auto or dali) imports when it is built
    import mshpc.train  # noqa: F401  (imported for its side effect: warm modules)
    from mshpc.__main__ import exit_without_teardown, run_cli
    from mshpc.data.dali_source import preload_dali

    preload_dali()
    if why := unsafe_to_fork():
        print(f"mshpc: fork server: cannot fork ranks: {why}", file=sys.stderr)
        exit_without_teardown(1)
    child = serve(control)
    if child is None:
        exit_without_teardown(0)  # a teardown with torch loaded would hold up the attempt's stop
    os.dup2(child.stderr_fd, 2)
    os.close(child.stderr_fd)
    os.environ.update(child.env)
    run_cli(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
