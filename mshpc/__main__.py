"""`python -m mshpc` and the `mshpc` command: the CLI, then a fast exit."""

import atexit
import os
import sys
import threading
from collections.abc import Sequence
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
    (logging's flush, multiprocessing's child clean-up) run, but those that only prepare the
    teardown (`skip_teardown_handlers`)."""
    threading._shutdown()  # type: ignore[attr-defined]  # no public name joins them as exit does
    skip_teardown_handlers()
    atexit._run_exitfuncs()  # the handlers sys.exit would run; no public name does this
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def skip_teardown_handlers() -> None:
    """Drop the atexit handlers that only prepare the teardown skipped here: DALI's runs a full
    gc.collect() (0.1-0.2 s of a rank's exit, with torch loaded) so its pipelines go before its
    library is unloaded, and nothing is unloaded before os._exit."""
    dali = sys.modules.get("nvidia.dali.backend")
    unload = getattr(dali, "_unload_dali", None)
    if unload is not None:
        atexit.unregister(unload)


def exit_code(exc: SystemExit) -> int:
    """The status `sys.exit` would end with for `exc`: None is 0, an int itself, anything else
    is printed to stderr and 1 (Python's own rule)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def run_cli(argv: Sequence[str] | None = None) -> NoReturn:
    """The CLI, then the fast exit, whether it returned or raised SystemExit: a rank stopped on
    request ends with JobStopped (a SystemExit) after its checkpoint, and a teardown there delays
    the stop, and the rerun after it, by a second."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exit_code(exc)
    exit_without_teardown(code)


def run() -> NoReturn:
    run_cli()


if __name__ == "__main__":
    run()
