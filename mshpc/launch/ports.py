"""A free TCP port, without importing torch: the local launcher needs one before it starts its
ranks, and importing torch there would delay every rank's start by ~2 s."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
