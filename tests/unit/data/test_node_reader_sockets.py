"""The per-node reader's sockets on a real SEQPACKET pair: a side that closes on purpose lets the
other still read every step already sent to it, however many acks it left unread."""

from __future__ import annotations

import secrets
import socket
import threading
import time

import pytest
from support.other_user import NOBODY, needs_root, nobody_python

from mshpc.data.node_reader import _STEP, _accept_clients, _close_cleanly, _connect, _hello, _recv_step
from mshpc.data.shared_ring import RingLayout, SharedRing
from mshpc.errors import DataError


def test_a_client_behind_the_reader_reads_every_sent_step_before_the_end() -> None:
    reader, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for step in range(3):
        reader.send(_STEP.pack(step))
    client.send(_STEP.pack(0))  # an ack the reader never reads: plain close() would reset the client
    _close_cleanly(reader)
    stop = threading.Event()
    assert [_recv_step(client, stop, "the reader") for _ in range(3)] == [0, 1, 2]
    with pytest.raises(DataError, match="the reader closed the connection"):
        _recv_step(client, stop, "the reader")
    client.close()


def test_closing_after_the_peer_has_gone_raises_nothing() -> None:
    reader, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.send(_STEP.pack(0))
    client.close()
    _close_cleanly(reader)
    assert reader.fileno() == -1


def _ring() -> SharedRing:
    return SharedRing.create(RingLayout(depth=2, served=(0, 1), local_batch=1, seq_len=4, segments=False))


@needs_root
def test_another_user_connecting_first_is_refused_and_the_rank_is_served() -> None:
    # issue #43, finding 2: another user connected first, was handed the batch ring read-write,
    # and took the place of the rank, which never got its batches
    address = "\0mshpc-data-test-" + secrets.token_hex(8)
    ring = _ring()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(4)
    intruder = nobody_python(
        "import json, socket\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        f"s.connect({address!r})\n"
        "print('connected', flush=True)\n"
        "try:\n"
        "    s.send(json.dumps({'rank': 1, 'dp': 1}).encode())\n"
        "    print('fds', len(socket.recv_fds(s, 4096, 1)[1]), flush=True)\n"
        "except OSError:\n"
        "    print('fds 0', flush=True)\n")
    assert intruder.stdout.readline() == "connected\n"  # queued first on the listener
    rank = threading.Thread(target=lambda: got.append(start_client_socket(address)))
    got: list = []
    rank.start()
    clients = _accept_clients(listener, ring, 1, time.monotonic() + 30)
    rank.join(30)
    assert intruder.wait(30) == 0 and intruder.stdout.read() == "fds 0\n"  # closed unread: no ring
    assert [who for _, who in clients] == ["rank 1 (client)"] and got and got[0] == 1
    for sock, _ in clients:
        sock.close()
    listener.close()
    ring.close()


def start_client_socket(address: str) -> int:
    """What a client rank does first: connect, say hello, receive the ring's descriptor."""
    sock = _connect(address, time.monotonic() + 30)
    sock.send(b'{"rank": 1, "dp": 1}')
    _, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    sock.close()
    return len(fds)


@needs_root
def test_a_rank_refuses_a_reader_socket_another_user_serves() -> None:
    address = "\0mshpc-data-test-" + secrets.token_hex(8)
    squatter = nobody_python(
        "import socket, time\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        f"s.bind({address!r}); s.listen(4)\n"
        "print('listening', flush=True)\n"
        "time.sleep(30)\n")
    try:
        assert squatter.stdout.readline() == "listening\n"
        with pytest.raises(DataError, match=f"is served by uid {NOBODY}, not this job's user"):
            _connect(address, time.monotonic() + 5)
    finally:
        squatter.kill()
        squatter.wait()


def test_a_malformed_hello_is_a_data_error() -> None:
    for raw in (b"", b"[1]", b'{"rank": "0", "dp": 0}', b"\xff" * 10):
        with pytest.raises(DataError, match="is not one of a rank's"):
            _hello(raw)
