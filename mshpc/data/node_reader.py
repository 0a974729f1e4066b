"""One reader per node: one rank prepares the batches of the ranks beside it into shared memory.

Start-up is one all-gather over the scope's group of (node, key, dp rank, token). Ranks with the
same (node, key) share a reader: the lowest rank among them. It serves their distinct dp ranks
(the ranks of one tensor-parallel group share a dp rank, so that batch is read once), keeps a
`SharedRing` of batches, listens on an abstract Unix socket named by its token, and hands the
ring's memfd to each client over that socket (SCM_RIGHTS).

Each step the reader waits until every client has acked the step that last used the slot,
writes the step's batches, and sends the step number to each client (SOCK_SEQPACKET, 8 bytes);
a client copies its rows out and acks. A connection closed on either side (a rank that exited
or crashed) raises DataError there; the reader then hangs up on every client, so no survivor
waits forever. There is no name to clean up: see shared_ring.py.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from mshpc.batch import Batch
from mshpc.data.loader import Stopped
from mshpc.data.shared_ring import RingLayout, SharedRing
from mshpc.data.window_reader import WindowReader
from mshpc.errors import DataError, shown
from mshpc.parallel import comm
from mshpc.socket_peer import is_same_user, peer_uid

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 300.0  # start-up: clients reach the reader, the reader hears from all clients
_POLL_S = 0.05  # how often a blocked wait looks at the stop flag
_STEP = struct.Struct("<q")
_SOCKET_PREFIX = "\0mshpc-data-"  # the abstract namespace: no file, gone with the socket


@dataclass(frozen=True)
class ReaderScope:
    """Where this rank sits: ranks with equal (node, key) share one reader. key 0 for every rank
    gives one reader per node; a tensor-parallel group id gives one per group."""

    node: str
    key: int = 0
    group: dist.ProcessGroup | None = None  # the start-up all-gather runs over it (None: world)


@dataclass(frozen=True)
class ReaderRole:
    reader: int  # group rank of this rank's reader
    address: str  # the reader's socket
    served: tuple[int, ...]  # dp ranks the reader prepares, in ring row order
    n_clients: int
    is_reader: bool


def find_role(scope: ReaderScope, dp_rank: int) -> ReaderRole:
    """This rank's reader and what it serves. Collective over `scope.group`."""
    mine = [scope.node, scope.key, dp_rank, secrets.token_hex(8)]
    everyone = comm.all_gather_json(mine, scope.group)
    members = [r for r, e in enumerate(everyone) if e[:2] == mine[:2]]
    served = tuple(dict.fromkeys(everyone[r][2] for r in members))  # distinct, in rank order
    reader = members[0]
    return ReaderRole(reader=reader, address=_SOCKET_PREFIX + everyone[reader][3], served=served,
                      n_clients=len(members) - 1, is_reader=dist.get_rank(scope.group) == reader)


def _gone(peer: str, exc: OSError | None = None) -> DataError:
    how = "" if exc is None or isinstance(exc, (BrokenPipeError, ConnectionResetError)) else f": {exc}"
    return DataError(f"per-node reader: {peer} closed the connection (it exited or crashed{how})")


def _recv_step(sock: socket.socket, stop: threading.Event, peer: str) -> int:
    """The next step number from `sock`; DataError when the peer has gone."""
    while True:
        if stop.is_set():
            raise Stopped
        try:
            msg = sock.recv(_STEP.size)
        except TimeoutError:
            continue
        except OSError as exc:
            raise _gone(peer, exc) from None
        if not msg:
            raise _gone(peer)
        return _STEP.unpack(msg)[0]


def _close_cleanly(sock: socket.socket) -> None:
    """Close so that the peer still reads what was sent to it. Linux resets the peer (ECONNRESET,
    reported before its queued messages) when a socket closes with unread messages of its own, so
    stop the peer's sends first, then drop what it already sent, then close."""
    try:
        sock.shutdown(socket.SHUT_RD)
        sock.setblocking(False)
        while sock.recv(_STEP.size):
            pass
    except OSError:
        pass  # drained (EAGAIN), or the peer is already gone
    sock.close()


def _send_step(sock: socket.socket, step: int, peer: str) -> None:
    try:
        sock.send(_STEP.pack(step))
    except OSError as exc:
        raise _gone(peer, exc) from None


class NodeReader:
    """The reader rank's source: prepares every served dp rank's batch of a step into the ring,
    tells the clients, and returns its own."""

    def __init__(self, windows: WindowReader, ring: SharedRing, own_dp: int,
                 clients: list[tuple[socket.socket, str]], start_step: int, stop: threading.Event) -> None:
        self.windows = windows
        self.ring = ring
        self.own_row = ring.layout.served.index(own_dp)
        self.clients = clients  # (socket, who) per client
        self.stop = stop
        self._acked = [start_step - 1] * len(clients)

    def _wait_for_slot(self, step: int) -> None:
        """Until every client has acked step - depth, the last user of this step's slot."""
        for i, (sock, who) in enumerate(self.clients):
            while self._acked[i] < step - self.ring.layout.depth:
                self._acked[i] = _recv_step(sock, self.stop, who)

    def batch(self, step: int) -> Batch:
        try:
            self._wait_for_slot(step)
            batches = [self.windows.batch(step, dp) for dp in self.ring.layout.served]
            for row, batch in enumerate(batches):
                self.ring.write(step, row, batch)
            for sock, who in self.clients:
                _send_step(sock, step, who)
        except DataError:
            self.hang_up()  # the clients see the end now, rather than waiting for a step
            raise
        return batches[self.own_row]

    def hang_up(self) -> None:
        for sock, _ in self.clients:
            _close_cleanly(sock)  # a client behind by a step or two still gets its batches

    def close(self) -> None:
        self.hang_up()
        self.ring.close()


class NodeClient:
    """A client rank's source: its rows of each step, copied out of the reader's ring."""

    def __init__(self, sock: socket.socket, ring: SharedRing, dp_rank: int, reader: str,
                 stop: threading.Event) -> None:
        self.sock = sock
        self.ring = ring
        self.row = ring.layout.served.index(dp_rank)
        self.reader = reader
        self.stop = stop

    def batch(self, step: int) -> Batch:
        ready = _recv_step(self.sock, self.stop, self.reader)
        assert ready == step, (ready, step)  # the reader sends every step, in order
        batch = self.ring.read(step, self.row)
        try:
            self.sock.send(_STEP.pack(step))
        except OSError:
            pass  # the reader has gone: it needs no ack, and the next receive reports the loss
        return batch

    def close(self) -> None:
        _close_cleanly(self.sock)
        self.ring.close()


def _accept_clients(listener: socket.socket, ring: SharedRing, n_clients: int,
                    deadline: float) -> list[tuple[socket.socket, str]]:
    """Each client says who it is; it gets the ring's layout and memfd back. A connection from
    another user (the socket's name is visible to all: /proc/net/unix) is closed unread, before
    it can take a client's place or the ring."""
    clients: list[tuple[socket.socket, str]] = []
    try:
        while len(clients) < n_clients:
            listener.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                raise DataError(f"per-node reader: {len(clients)} of {n_clients} local ranks "
                                "connected before the time-out; the others did not start") from None
            if not is_same_user(sock):
                log.warning("per-node reader: refused a connection from uid %d (not this job's user)", peer_uid(sock))
                sock.close()
                continue
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            hello = _hello(sock.recv(4096))
            clients.append((sock, f"rank {hello['rank']} (client)"))
            if hello["dp"] not in ring.layout.served:
                raise DataError(f"per-node reader: a client asked for dp rank {hello['dp']}, "
                                f"not one of {list(ring.layout.served)}")
            socket.send_fds(sock, [ring.layout.to_json()], [ring.fd])
            sock.settimeout(_POLL_S)
    except BaseException:
        for sock, _ in clients:
            sock.close()
        raise
    return clients


def _hello(raw: bytes) -> dict[str, int]:
    """A client's hello, {"rank": int, "dp": int}, or a DataError."""
    try:
        hello = json.loads(raw)
    except (ValueError, RecursionError):
        hello = None
    if not (isinstance(hello, dict) and all(type(hello.get(k)) is int for k in ("rank", "dp"))):
        raise DataError(f"per-node reader: a client's hello {shown(raw)} is not one of a rank's")
    return hello


def start_reader(windows: WindowReader, role: ReaderRole, dp_rank: int, start_step: int,
                 depth: int, stop: threading.Event, timeout_s: float) -> NodeReader:
    layout = RingLayout(depth=depth, served=role.served, local_batch=windows.local_batch,
                        seq_len=windows.sampler.seq_len, segments=windows.eos_id is not None)
    ring = SharedRing.create(layout)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            listener.bind(role.address)
            listener.listen(max(1, role.n_clients))
            clients = _accept_clients(listener, ring, role.n_clients, time.monotonic() + timeout_s)
        ring.release_fd()  # every client holds its own descriptor now
    except BaseException:
        ring.close()
        raise
    return NodeReader(windows, ring, dp_rank, clients, start_step, stop)


def _connect(address: str, deadline: float) -> socket.socket:
    """A connection to the reader at `address`, which must run as this user: a listener of
    another user on that name would hand this rank its own batches."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    while True:
        try:
            sock.connect(address)
            if not is_same_user(sock):
                uid = peer_uid(sock)
                sock.close()
                raise DataError(f"per-node reader: the socket {address[1:]!r} is served by uid {uid}, not this "
                                "job's user; another user took its name")
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                sock.close()
                raise DataError("per-node reader: no reader listening after the time-out; "
                                "did the local rank that reads start?") from None
            time.sleep(_POLL_S)


def start_client(windows: WindowReader, role: ReaderRole, dp_rank: int, rank: int,
                 depth: int, stop: threading.Event, timeout_s: float) -> NodeClient:
    deadline = time.monotonic() + timeout_s
    sock = _connect(role.address, deadline)
    try:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.send(json.dumps({"rank": rank, "dp": dp_rank}).encode())
        msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        if not fds:
            raise DataError("per-node reader: the reader closed the connection during start-up")
        ring = SharedRing(fds[0], RingLayout.from_json(msg))
        ring.release_fd()  # the mapping keeps the memory
        want = (depth, windows.local_batch, windows.sampler.seq_len, windows.eos_id is not None)
        got = ring.layout
        if (got.depth, got.local_batch, got.seq_len, got.segments) != want:
            ring.close()
            raise DataError(f"per-node reader: its batches {got} differ from this rank's {want}; "
                            "do all ranks run the same config?")
        sock.settimeout(_POLL_S)
    except BaseException:
        sock.close()
        raise
    return NodeClient(sock, ring, dp_rank, f"the reader (rank {role.reader})", stop)


def start_node_source(windows: WindowReader, scope: ReaderScope, dp_rank: int, start_step: int,
                      depth: int, stop: threading.Event,
                      timeout_s: float = CONNECT_TIMEOUT_S) -> NodeReader | NodeClient:
    """This rank's end of its reader group. Collective over `scope.group`: every rank of it calls
    this; a start-up failure on any rank raises on all of them."""
    role = find_role(scope, dp_rank)
    source: NodeReader | NodeClient | None = None
    error: BaseException | None = None
    try:
        if role.is_reader:
            source = start_reader(windows, role, dp_rank, start_step, depth, stop, timeout_s)
        else:
            rank = dist.get_rank(scope.group)
            source = start_client(windows, role, dp_rank, rank, depth, stop, timeout_s)
    except (DataError, OSError) as exc:
        error = exc
    try:
        comm.raise_if_any_failed(error, "starting the per-node reader", scope.group)
    except BaseException:
        if source is not None:
            source.close()
        raise
    assert source is not None
    return source
