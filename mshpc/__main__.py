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
    what the OS frees anyway, and a restart waits for every rank to be gone. atexit handlers
    (logging's flush, multiprocessing's child clean-up) still run. While a non-daemon thread
    runs, a normal exit is taken, since that one waits for the thread."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(t.is_alive() and not t.daemon for t in others):
        sys.exit(code)
    atexit._run_exitfuncs()  # the handlers sys.exit would run; no public name does this
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> NoReturn:
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
