"""Local ranks die with the process that started them: PR_SET_PDEATHSIG (Linux), set in each child
between fork and exec, so a launcher or supervisor killed with -9 (which no handler sees) leaves
no rank training on alone, re-parented to PID 1, writing into a run directory nobody watches.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen that makes the child get SIGKILL when its parent dies;
    None where the kernel has no such setting (not Linux). The parent is the *thread* that calls
    Popen: the supervisor and the local launcher start their ranks from the main thread."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL.value, 0, 0, 0)
        # the parent may have died between fork and prctl: then no signal would ever come
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child
