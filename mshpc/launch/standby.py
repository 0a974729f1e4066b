"""A warm standby rank: a process started ahead with torch and the train loop imported, waiting
to take a lost rank's place in a recovery in place (mshpc/launch/in_place.py), as ByteRobust keeps
warm standbys. A cold start imports torch first, 2.5-3 CPU-s here, more than the whole recovery
is allowed; a standby has paid that before any fault.

    python -m mshpc.launch.standby ARGV...     (ARGV: the ranks' own `mshpc` arguments)

Its launcher writes one JSON line to its stdin, {"env": {NAME: VALUE, ...}}: the variables that
make it a rank (RANK, MASTER_PORT, MSHPC_NODE, ...). It then runs `mshpc ARGV` as that rank, in
this process, and exits as a rank does. End of input before that line: it exits 0, unused.
"""

from __future__ import annotations

import json
import os
import sys

ENV_MAX_BYTES = 64 * 1024  # a rank's variables: a few hundred bytes


def read_assignment(line: str) -> dict[str, str]:
    """The variables of one assignment line; ValueError for anything but an object of strings."""
    if len(line) > ENV_MAX_BYTES:
        raise ValueError(f"a standby's assignment of {len(line)} bytes (at most {ENV_MAX_BYTES})")
    message = json.loads(line)
    env = message.get("env") if isinstance(message, dict) else None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("a standby's assignment must be {\"env\": {NAME: VALUE, ...}} of strings")
    return env


def main(argv: list[str]) -> int:
    # the imports a rank's start-up would pay, paid now: the CLI, torch, the train loop, and
    # DALI, which a loader (data.loader auto or dali) imports when it is built
    import mshpc.train  # noqa: F401  (imported for its side effect: warm modules)
    from mshpc.__main__ import run_cli
    from mshpc.data.dali_source import preload_dali

    preload_dali()

    line = sys.stdin.readline()
    if not line:
        return 0
    os.environ.update(read_assignment(line))
    run_cli(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
