"""The node relay's socket, whose name every user of the node can list (issue #43, findings 2 and
3): another user's connection is dropped before a byte is read; a connection of the job's user
must say its hello, with the attempt's token, within a deadline and a size; each connection and
all of them together hold bounded bytes, and their number is bounded. The real relay, in a
thread, against a real monitor."""

import asyncio
import json
import socket
import threading

import pytest
from support.other_user import needs_root, nobody_python
from support.waiting import wait_until

from mshpc.launch import node_relay
from mshpc.launch.env import SupervisorLink
from mshpc.launch.heartbeat import Heartbeat, RelayPlan
from mshpc.launch.monitor import Monitor
from mshpc.launch.node_relay import Relay, socket_name
from mshpc.save_schedule import SaveSchedule

TOKEN = "tok-" + "0" * 28


@pytest.fixture
def relay():
    monitor = Monitor(2, TOKEN)
    relay = Relay(SupervisorLink("127.0.0.1", monitor.port, TOKEN, 0), "n0", 0.05)
    thread = threading.Thread(target=lambda: asyncio.run(relay.run()), daemon=True)
    thread.start()
    wait_until(lambda: relay._up is not None, 30)
    yield relay, monitor
    monitor.close()  # the supervisor's connection ends: so does the relay
    thread.join(30)


def connect() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_name(TOKEN, "n0"))
    return sock


def hello(rank: int, token: str = TOKEN) -> bytes:
    return (json.dumps({"type": "hello", "token": token, "rank": rank, "host": "n0", "pid": None}) + "\n").encode()


def flood(sock: socket.socket, nbytes: int) -> int:
    """Send up to `nbytes` without a newline; how many went before the relay hung up."""
    sent, chunk = 0, b"x" * 2**16
    sock.settimeout(10)
    try:
        while sent < nbytes:
            sent += sock.send(chunk[: nbytes - sent])
    except OSError:
        pass
    return sent


def dropped(sock: socket.socket, within_s: float = 10.0) -> bool:
    """Whether the relay closes `sock` within `within_s` (a reset counts as closed)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@needs_root
def test_another_users_connections_are_dropped_unread_and_the_ranks_still_report(relay, caplog):
    r, monitor = relay
    # the attack: three connections of another user, each sending what it can without a
    # newline, took the relay from 24 MB to 793 MB before any token check
    intruder = nobody_python(
        "import socket\n"
        f"name = {socket_name(TOKEN, 'n0')!r}\n"
        "total = 0\n"
        "for _ in range(3):\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(name); s.settimeout(10)\n"
        "    try:\n"
        "        while total < 3 * 256 * 2**20:\n"
        "            total += s.send(b'x' * 2**16)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(total, flush=True)\n")
    sent = int(intruder.communicate(timeout=60)[0])
    assert sent < 3 * 2**20  # what the kernel's socket buffers took before each reset, nothing more
    # dropped for its uid before a byte was read (the hello bounds alone would also end it, later)
    assert caplog.text.count("refused a connection from uid 65534 (not this job's user)") == 3
    assert r.buffered == 0 and not r.connections
    rank = connect()
    rank.sendall(hello(0))
    wait_until(lambda: monitor.ranks[0].host == "n0", 10)
    rank.close()


def test_a_hello_past_its_size_or_deadline_or_without_the_token_is_dropped(relay, monkeypatch):
    r, monitor = relay
    big = connect()
    assert flood(big, 8 * 2**20) < 4 * 2**20 and dropped(big)  # dropped past 64 KiB, not 256 MiB
    for token in ("another attempt's", "tok-é", "\ud800"):
        wrong = connect()
        wrong.sendall(hello(0, token=token))
        assert dropped(wrong)
    monkeypatch.setattr(node_relay, "HELLO_TIMEOUT_S", 0.2)
    silent = connect()
    assert dropped(silent)  # within the 10 s timeout: the deadline, not the test's patience
    wait_until(lambda: r.buffered == 0 and not r.connections, 10)
    assert monitor.ranks[0].host is None  # none of them spoke for a rank


def test_connections_and_buffered_bytes_are_bounded(relay, monkeypatch):
    r, monitor = relay
    monkeypatch.setattr(node_relay, "HELLO_TIMEOUT_S", 120.0)  # the held ones stay however slow the machine
    monkeypatch.setattr(node_relay, "MAX_CONNECTIONS", 3)
    held = [connect() for _ in range(3)]
    wait_until(lambda: len(r.connections) == 3, 10)
    assert dropped(connect())  # the fourth
    monkeypatch.setattr(node_relay, "TOTAL_BUFFER_BYTES", 2**20)
    for rank, sock in enumerate(held[:2]):
        sock.sendall(hello(rank))
    wait_until(lambda: monitor.ranks[0].host == monitor.ranks[1].host == "n0", 10)
    first = flood(held[0], 600 * 1024)
    assert first == 600 * 1024 and not dropped(held[0], within_s=0.3)  # a long line, under the total
    flood(held[1], 600 * 1024)  # together past the total: this one goes
    assert dropped(held[1])
    wait_until(lambda: r.buffered <= 2**20, 10)
    for sock in held:
        sock.close()


@needs_root
def test_a_rank_trusts_no_relay_socket_another_user_serves(caplog):
    monitor = Monitor(1, TOKEN)
    squatter = nobody_python(
        "import socket, time\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.bind({socket_name(TOKEN, 'n9')!r}); s.listen(4)\n"
        "print('listening', flush=True)\n"
        "c, _ = s.accept(); print('accepted', flush=True); time.sleep(30)\n")
    try:
        assert squatter.stdout.readline() == "listening\n"
        link = SupervisorLink("127.0.0.1", monitor.port, TOKEN, 0)
        with Heartbeat(link, {"rank": 0, "host": "n9"}, 0.05, SaveSchedule(0, 10), relay=RelayPlan("n9", start=False)):
            wait_until(lambda: monitor.ranks[0].host == "n9", 10)  # its own connection, not the squatter's
        assert "served by uid 65534, not this job's user" in caplog.text
    finally:
        squatter.kill()
        squatter.wait()
        monitor.close()
