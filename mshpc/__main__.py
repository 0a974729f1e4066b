"""`python -m mshpc` and the `mshpc` command: the CLI, then a fast exit."""

import atexit
import os
import sys
import threading
from typing import NoReturn

from mshpc.cli import main


def exit_without_teardown(code: int) -> NoReturn:
    """End the process as `sys.exit(code)` would, minus the interpreter's teardown of its
    modules: with torch, dynamo and DALI loaded that takes 0.5-1.5 s per process and frees only
    what the OS frees anyway, and a restart waits for every rank to be gone. Worse, a daemon
    thread still inside torch (a gloo collective of a checkpoint in flight) aborts the process
    while the interpreter is torn down under it, and the supervisor then reports that signal
    instead of the rank's own error. What sys.exit does before the teardown is kept: non-daemon
    threads are joined (threading's own shutdown, executors included) and atexit handlers
    (logging's flush, multiprocessing's child clean-up) run."""
    threading._shutdown()  # type: ignore[attr-defined]  # no public name joins them as exit does
    atexit._run_exitfuncs()  # the handlers sys.exit would run; no public name does this
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> NoReturn:
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
