"""The heartbeat server against a hostile peer: a real Monitor on a real socket. Nothing a peer
sends raises in the monitor's threads, a connection that says no valid hello in time is dropped,
and a real rank is served as before."""

import contextlib
import json
import socket
import threading
import time

import pytest

from mshpc.launch.env import SupervisorLink
from mshpc.launch.heartbeat import Heartbeat
from mshpc.launch.monitor import Monitor
from mshpc.save_schedule import SaveSchedule

HELLO_TIMEOUT_S = 0.5  # the product's is 5 s; short here so that the test is quick
NO_SAVES = SaveSchedule(interval_steps=0, last_step=0)
HELLO = {"type": "hello", "token": "tok", "rank": 0, "host": "h", "pid": 1, "coords": "(dp=0, tp=0, pp=0)"}


@contextlib.contextmanager
def thread_errors():
    """Every exception that escapes a thread in the block. Entered in the test's body: pytest puts
    its own hook in place for each phase of a test and would replace one set by a fixture."""
    seen, before = [], threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)
    try:
        yield seen
    finally:
        threading.excepthook = before


def readers_done(within_s: float = 10) -> None:
    """Until the monitor's connection threads (`Monitor._read`) have ended, excepthook included."""
    deadline = time.monotonic() + within_s
    while any(t.name.endswith("(_read)") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def monitor():
    m = Monitor(1, "tok", hello_timeout_s=HELLO_TIMEOUT_S)
    yield m
    m.close()


def connect(monitor: Monitor) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", monitor.port), timeout=10)
    return conn


def closed_by_server(conn: socket.socket, within_s: float) -> bool:
    """Whether the monitor closes `conn` within `within_s` (reads to the end; False on timeout)."""
    conn.settimeout(within_s)
    try:
        while conn.recv(4096):
            pass
        return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True
    finally:
        conn.close()


def line(obj) -> bytes:
    return (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n"


BAD_HELLOS = {
    "list": b"[1,2,3]",
    "number": b"42",
    "null": b"null",
    "string": b'"hello"',
    "not json": b"GET / HTTP/1.0",
    "not utf-8": b"\xff\xfe\x00{",
    "deep": b"[" * 50_000,  # under the hello's size limit: the JSON parser's own depth limit
    "too long": b"{" + b" " * 100_000 + b"}",
    "type not a string": {"type": ["hello"], "token": "tok", "rank": 0},
    "rank a string": {**HELLO, "rank": "0"},
    "rank a bool": {**HELLO, "rank": True},
    "rank out of range": {**HELLO, "rank": 7},
    "token a list": {**HELLO, "token": ["tok"]},
    "host a number": {**HELLO, "host": 3},
    "no token": {"type": "hello", "rank": 0},
    "a beat first": {"type": "beat", "phase": "step", "step": 1, "phase_s": 0.1, "medians": {}, "counts": {},
                     "last": None},
}


@pytest.mark.parametrize("name", BAD_HELLOS)
def test_a_bad_first_line_is_dropped_without_an_exception(name, monitor):
    with thread_errors() as errors:
        conn = connect(monitor)
        conn.sendall(line(BAD_HELLOS[name]))
        assert closed_by_server(conn, within_s=10), "the monitor kept a connection that said no valid hello"
        readers_done()
    assert errors == []
    assert monitor.ranks[0].host is None and monitor.ranks[0].closed_at is None


BAD_MESSAGES = [
    b"[1,2,3]", b"42", b"null", b"{", b"\xff",
    {"type": "beat", "phase": 3, "step": 1, "phase_s": 0.1, "medians": {}, "counts": {}, "last": None},
    {"type": "beat", "phase": "step", "step": "1", "phase_s": 0.1, "medians": {}, "counts": {}, "last": None},
    {"type": "beat", "phase": "step", "step": 1, "phase_s": 0.1, "medians": {"step": "x"}, "counts": {},
     "last": None},
    {"type": "beat", "phase": "step", "step": 1, "phase_s": 0.1, "medians": {}, "counts": [], "last": [1]},
    {"type": "failed"},  # would leave an outcome the supervisor's describe() cannot read
    {"type": "failed", "t": "now", "error": "E", "message": "m", "user_error": False, "loss_diverged": False,
     "phase": "step", "step": 1},
    {"type": "exit", "how": "stopped", "code": "x"},
    {"type": "started", "start_step": None},
    {"type": "dump", "stacks": "", "records": [[1, "world"]], "counts": {}},
]


def test_a_rank_s_malformed_messages_are_ignored_and_its_good_ones_kept(monitor):
    with thread_errors() as errors:
        conn = connect(monitor)
        conn.sendall(line(HELLO))
        for bad in BAD_MESSAGES:
            conn.sendall(line(bad))
        good = {"type": "beat", "phase": "step", "step": 5, "phase_s": 0.2, "medians": {"step": 0.1},
                "counts": {"world": 3}, "last": [3, "world", "all_reduce", 4]}
        conn.sendall(line(good))
        state = monitor.ranks[0]
        deadline = time.monotonic() + 10
        while state.step != 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (state.host, state.step, state.phase, state.outcome, state.start_step) == ("h", 5, "step", None, None)
        assert state.closed_at is None  # still listening to it
        conn.close()
        readers_done()
    assert errors == []


def test_a_silent_connection_is_closed_after_the_hello_timeout(monitor):
    with thread_errors() as errors:
        conn = connect(monitor)
        start = time.monotonic()
        assert closed_by_server(conn, within_s=HELLO_TIMEOUT_S + 5), "a silent connection was held"
        assert HELLO_TIMEOUT_S - 0.05 <= time.monotonic() - start
        readers_done()
    assert errors == []


def test_a_hello_that_trickles_in_is_cut_at_the_timeout(monitor):
    # a byte at a time resets any per-read timeout: the deadline is the whole hello's
    with thread_errors() as errors:
        conn = connect(monitor)
        start, data = time.monotonic(), line(HELLO)
        for byte in data[:-1]:
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                break  # closed under us: what the test wants
            if time.monotonic() - start > HELLO_TIMEOUT_S + 5:
                break
            time.sleep(0.02)
        assert closed_by_server(conn, within_s=5)
        assert time.monotonic() - start < HELLO_TIMEOUT_S + 5
        readers_done()
    assert monitor.ranks[0].host is None and errors == []


def test_after_the_garbage_a_real_rank_is_served(monitor):
    with thread_errors() as errors:
        junk = [connect(monitor) for _ in range(5)]
        for conn, bad in zip(junk, [b"[1,2,3]", b"42", b"null", b"", b"{}"], strict=True):
            conn.sendall(line(bad) if bad else b"")
        link = SupervisorLink("127.0.0.1", monitor.port, "tok", 0)
        with Heartbeat(link, {"rank": 0, "host": "real", "coords": "(dp=0, tp=0, pp=0)"}, 0.05, NO_SAVES) as beat:
            beat.phase("data", 0)
            beat.phase("step", 0)
            deadline = time.monotonic() + 10
            while monitor.ranks[0].step != 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert (monitor.ranks[0].host, monitor.ranks[0].step, monitor.ranks[0].start_step) == ("real", 0, 0)
        deadline = time.monotonic() + 10
        while monitor.ranks[0].outcome is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert monitor.ranks[0].outcome["how"] == "ok"
        for conn in junk:
            assert closed_by_server(conn, within_s=HELLO_TIMEOUT_S + 5)
        readers_done()
    assert errors == []
