"""Who is at the other end of a Unix socket, in the kernel's words (SO_PEERCRED), which a peer
cannot forge.

mshpc's Unix sockets live in the abstract namespace, and every user of a node can list those
names (/proc/net/unix) and connect to them. So each end checks the other before it reads or
sends anything that matters: a listener drops a peer of another user at once, and a client
trusts a listener only if it runs as the same user. Root's processes are another user too: a
job never needs them on its sockets.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket | Any) -> int:
    """The user id of the process at the other end of the connected Unix socket `sock` (a
    socket, or asyncio's view of one), as it was when the connection was made."""
    _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def is_same_user(sock: socket.socket | Any) -> bool:
    """Whether the peer of the connected Unix socket `sock` runs as this process's user."""
    return peer_uid(sock) == os.geteuid()
