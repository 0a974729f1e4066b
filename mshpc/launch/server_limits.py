"""What the supervisor's heartbeat server needs from the machine at a large world: one file
descriptor per rank connection, and a listen backlog that holds every rank connecting at once."""

from __future__ import annotations

import resource
import socket
from pathlib import Path

from mshpc.errors import LaunchError

FD_MARGIN = 256  # the supervisor's own files: logs, events, the local ranks' pipes, the listener
MIN_BACKLOG = 128  # Python's default: a small world gets no less than it had
_SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def ensure_descriptors(world: int) -> int:
    """Raise the soft RLIMIT_NOFILE to `world` connections plus FD_MARGIN when it is lower (the
    usual 1,024 is past at 1,024 ranks); a LaunchError when the hard limit is lower. The soft limit."""
    need = world + FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        raise LaunchError(f"the supervisor needs {need} open files for {world} rank connections, but the hard "
                          f"limit (ulimit -Hn, RLIMIT_NOFILE) is {hard}: raise it (ulimit -n {need}, or "
                          "nofile in /etc/security/limits.conf)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need


def listen_backlog(world: int) -> int:
    """Room for every rank's connect at once, up to the kernel's cap (net.core.somaxconn): past
    the backlog the kernel drops SYNs and a rank waits out TCP's retransmission (1 s, 3 s, ...)."""
    try:
        cap = int(_SOMAXCONN.read_text())
    except (OSError, ValueError):
        cap = socket.SOMAXCONN
    return min(max(world, MIN_BACKLOG), cap)
