"""The per-node reader's sockets on a real SEQPACKET pair: a side that closes on purpose lets the
other still read every step already sent to it, however many acks it left unread."""

from __future__ import annotations

import socket
import threading

import pytest

from mshpc.data.node_reader import _STEP, _close_cleanly, _recv_step
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
