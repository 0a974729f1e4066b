"""Rank 0's rendezvous store listens on a plain IPv4 socket (launch.rendezvous.listen_ipv4), so
its accepts name their peers from /etc/hosts rather than by a reverse DNS query each; a port
already taken is a one-line LaunchError."""

import socket
import threading
from pathlib import Path

import pytest

from mshpc.errors import LaunchError
from mshpc.launch.ports import free_port
from mshpc.launch.rendezvous import connect_store


def listening(port: int, table: str) -> bool:
    """Whether /proc/net/<table> (tcp: IPv4, tcp6: IPv6 and dual-stack) lists a listener on port."""
    rows = Path("/proc/net", table).read_text().splitlines()[1:]
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)


def test_rank_0_serves_the_store_over_ipv4_and_a_rank_reaches_it():
    port = free_port()
    server = connect_store("127.0.0.1", port, rank=0, world_size=2, timeout_s=30)
    assert listening(port, "tcp") and not listening(port, "tcp6")
    got = {}
    client = threading.Thread(target=lambda: got.update(store=connect_store("127.0.0.1", port, 1, 2, 30)))
    client.start()
    client.join(30)
    got["store"].set("addr", b"rank 1")
    assert server.get("addr") == b"rank 1"


def test_a_taken_port_is_a_one_line_launch_error():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port}") as err:
            connect_store("127.0.0.1", port, rank=0, world_size=2, timeout_s=5)
    assert "\n" not in str(err.value)
