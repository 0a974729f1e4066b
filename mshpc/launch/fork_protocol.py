"""What a launcher and its fork server (mshpc/launch/fork_server.py) say to each other, on a
SOCK_SEQPACKET socket whose descriptor the server finds in MSHPC_FORK_SERVER_FD: one JSON object
per message. A request, {"fork": N, "env": {NAME: VALUE, ...}}, carries one descriptor, the rank's
stderr; the server answers {"forked": N, "pid": PID} at once and {"exit": PID, "code": C} when
the rank ends (C as Popen's returncode: -SIGNAL for a signal).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

FD_ENV = "MSHPC_FORK_SERVER_FD"
MESSAGE_MAX_BYTES = 64 * 1024  # a request: a rank's few dozen variables


@dataclass(frozen=True)
class Request:
    number: int
    env: dict[str, str]


def read_request(data: bytes) -> Request:
    """One fork request; ValueError for anything but {"fork": int, "env": {str: str}}."""
    message = json.loads(data)
    if not isinstance(message, dict) or not isinstance(message.get("fork"), int):
        raise ValueError('a fork request must be {"fork": N, "env": {NAME: VALUE, ...}}')
    env = message.get("env")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("a fork request's env must be an object of strings")
    return Request(message["fork"], env)
