"""The monitor's side of the node-level protocol (mshpc/launch/node_relay.py), on a real socket:
a relay speaks only for the ranks whose hello it passed on, with this attempt's token and
protocol version; a batch with one bad entry is not taken; a beat is dated when its rank sent
it; a rank's "closed" and the relay's own end end the ranks (at per-rank precision)."""

import socket
import time

import pytest
from support.waiting import wait_until

from mshpc.launch.monitor import BEAT_ENTRY, NODE_PROTOCOL, Monitor
from mshpc.launch.monitor import beat_entry as entry_ok
from mshpc.launch.node_relay import beat_entry, beats_message, closed_message, line, node_hello, rank_envelope

BEAT = {"type": "beat", "phase": "step", "step": 3, "phase_s": 0.0, "medians": {}, "counts": {}, "last": None}


def hello(rank: int, token: str = "tok") -> bytes:
    return line(rank_envelope(rank, {"type": "hello", "token": token, "rank": rank, "host": "n", "pid": None}))


@pytest.fixture
def monitor():
    m = Monitor(4, "tok", hello_timeout_s=1.0)
    yield m
    m.close()


def relay(monitor: Monitor, *lines: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", monitor.port), timeout=10)
    conn.sendall(b"".join(lines))
    return conn


@pytest.mark.parametrize("first", [{**node_hello("tok", "n", 1), "v": NODE_PROTOCOL + 1}, node_hello("other", "n", 1),
                                   {"type": "node", "v": NODE_PROTOCOL, "token": "tok"}])
def test_a_relay_of_another_version_or_attempt_or_shape_is_dropped(monitor, first):
    conn = relay(monitor, line(first), hello(0))
    assert conn.recv(10) == b""  # dropped
    assert monitor.ranks[0].host is None


def test_a_relay_speaks_only_for_its_ranks_and_a_beat_is_dated_when_sent(monitor):
    conn = relay(monitor, line(node_hello("tok", "n", 1)), hello(1), hello(2, token="old"),
                 line(beats_message([beat_entry(0, BEAT, 0.0)])),  # rank 0 never said hello here
                 line(beats_message([beat_entry(1, BEAT, 0.0), {"rank": 2}])),  # one bad entry: none taken
                 line(beats_message([beat_entry(1, {**BEAT, "step": 4}, 0.5)])))
    wait_until(lambda: monitor.ranks[1].step == 4)
    assert monitor.ranks[0].step == -1 and monitor.ranks[0].host is None
    assert monitor.ranks[2].host is None  # its hello carried another attempt's token
    assert time.monotonic() - monitor.ranks[1].last_beat_at >= 0.5
    conn.close()


def test_a_ranks_end_is_its_own_and_the_relays_end_is_its_nodes(monitor):
    conn = relay(monitor, line(node_hello("tok", "n", 1)), hello(0), hello(1),
                 line(rank_envelope(0, {"type": "started", "start_step": 7})), line(closed_message(0, 123.0)))
    wait_until(lambda: monitor.ranks[0].closed_at is not None)
    assert monitor.ranks[0].closed_at == 123.0 and monitor.ranks[0].start_step == 7
    assert monitor.ranks[1].closed_at is None
    conn.close()
    wait_until(lambda: monitor.ranks[1].closed_at is not None)
    assert monitor.ranks[2].closed_at is None  # never its node's


GOOD = {**beat_entry(3, BEAT, 0.25), "medians": {"step": 0.5, "data": 1}, "counts": {"world": 4, "[0, 1]": 2},
        "last": [4, "world", "all_reduce", 64]}
BAD_VALUES = [None, True, "1", 1.5, [], {}, {"k": True}, {"k": "v"}, {1: 2}, [1, "g", "op"], [1, "g", "op", True]]


def test_the_written_out_beat_check_agrees_with_the_generic_one():
    def generic(entry):
        return isinstance(entry, dict) and all(check(entry.get(k)) for k, check in BEAT_ENTRY.items())

    cases = [GOOD, None, [], {**GOOD, "extra": 1}]
    cases += [{k: v for k, v in GOOD.items() if k != key} for key in GOOD]
    cases += [{**GOOD, key: bad} for key in GOOD for bad in BAD_VALUES]
    assert any(entry_ok(c) for c in cases) and not all(entry_ok(c) for c in cases)
    assert [entry_ok(c) for c in cases] == [generic(c) for c in cases]


def test_a_rank_whose_relay_never_listens_reports_directly(monitor):
    from mshpc.launch.env import SupervisorLink
    from mshpc.launch.heartbeat import Heartbeat, RelayPlan
    from mshpc.save_schedule import SaveSchedule

    link = SupervisorLink("127.0.0.1", monitor.port, "tok", 0)
    relay = RelayPlan("nobody-starts-this-node", start=False, wait_s=0.3)
    with Heartbeat(link, {"rank": 3, "host": "h"}, 0.05, SaveSchedule(0, 10), relay=relay):
        wait_until(lambda: monitor.ranks[3].host == "h")  # its own connection: its hello
    wait_until(lambda: monitor.ranks[3].outcome is not None)
    assert monitor.ranks[3].outcome["how"] == "ok"
    assert not any(getattr(k.data, "host", None) for k in monitor._selector.get_map().values())  # no relay spoke
