"""ZeRO's bucket buffers in shared memory, for dp ranks on one host (`parallel.dp_shared_memory`,
on CPU ranks only: tunings.py): the reduce-scatter and the all-gather read each peer's rows
straight from its buffer instead of moving them over gloo.

Why: gloo has one transport, TCP. Between CPU ranks of one host every byte of a bucket goes
through loopback: the sender's write copies it into the kernel, the receiver's read copies it out,
each on a core the ranks' compute needs, and the posting thread blocks on gloo's pair locks while
the transfer runs. NCCL uses shared memory or NVLink between GPUs of a node, and DeepSpeed's CPU
all-reduce shared memory; here a rank maps its peers' bucket buffers (one file per rank in
/dev/shm, made without a name: O_TMPFILE) and gloo carries only a one-byte "ready" per peer per
collective, which orders the reads.

A buffer never has a name, so no exit (kill -9 between creation and mapping included) leaves one
behind: the kernel frees it with its last descriptor or mapping. A peer maps it through its
owner's descriptor (/proc/<pid>/fd/<fd>, which only the same user may open), and only after
checking that what opened is the very file its owner announced (device and inode), on the same
host (boot id) and shared-memory folder, owned by this user: ranks that cannot, or another user's
file, leave the buckets in private memory. Results are bitwise those of the point-to-point
transport (gloo_p2p.py): the same sums in the same order.

The reads happen in a collective's wait(), so a rank must not rewrite rows its peers may still be
reading. The engine (zero.py) keeps that: a rank's gradient rows are rewritten only in the next
step's backward, after its peers' all-gathers of this step, which they post after their last
read; its parameter rows only at its next step, after the next step's reduce-scatter signals,
which a rank posts only once all of this step's gathers are done.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mshpc.cpu_ranks.gloo_p2p import Pieces, exchange, peers_of
from mshpc.parallel import comm

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")  # a tmpfs on Linux; a rank that cannot create its file there falls back
_ALIGN = 4096  # each buffer starts on a page of its own


@dataclass(frozen=True)
class HostShared:
    """Buffers every member of `group` holds, each mapped by all of them: local[i] is this rank's
    buffer i, remote[j][i] member j's (remote[me] is local)."""

    group: dist.ProcessGroup | None
    me: int  # this rank's index in the group
    peers: tuple[tuple[int, int], ...]  # every other member: (index, global rank), in group order
    remote: tuple[tuple[torch.Tensor, ...], ...]

    @property
    def local(self) -> tuple[torch.Tensor, ...]:
        return self.remote[self.me]


def map_buffers(specs: list[tuple[int, torch.dtype]], group: dist.ProcessGroup | None) -> HostShared | None:
    """Collective over `group` (gloo): buffers of (numel, dtype) each, zeroed, in memory every
    member maps; None when some member cannot create its file in SHM_DIR (no room, no tmpfs) or
    cannot see the others' (ranks on other hosts): then the buckets stay in private memory."""
    me, peers = peers_of(group)
    offsets, nbytes = _layout(specs)
    fd = create_unnamed(nbytes)
    try:
        maps = _map_all(comm.all_gather_json(identity(fd), group), me, fd, nbytes, group)
        comm.barrier(group)  # every member has opened every descriptor it needs: this one may close
    finally:
        if fd is not None:
            os.close(fd)  # the mappings keep the memory; nothing has a name to leave behind
    if maps is None:
        return None
    remote = tuple(tuple(_views(m, specs, offsets)) for m in maps)
    return HostShared(group, me, tuple(peers), remote)


def _map_all(everyone: list[dict | None], me: int, fd: int | None, nbytes: int,
             group: dist.ProcessGroup | None) -> list[mmap.mmap] | None:
    ids = [who for who in everyone if who is not None]
    if fd is None or len(ids) < len(everyone):
        log.info("dp buckets in private memory: a rank could not create its buffer in %s", SHM_DIR)
        return None
    maps = [map_peer(fd if j == me else None, who, ids[me], nbytes) for j, who in enumerate(ids)]
    if not all(comm.all_gather_json(all(m is not None for m in maps), group)):
        log.info("dp buckets in private memory: the dp ranks do not share one host's %s", SHM_DIR)
        return None
    return [m for m in maps if m is not None]


def reduce_scatter(shared: HostShared, index: int, output: torch.Tensor) -> comm.Pending:
    """Async: `output` becomes the sum over members of chunk `me` of their buffer `index`
    (comm.reduce_scatter's result, bitwise). `output` may be this rank's own chunk of it."""
    size = len(shared.peers) + 1
    rows = [buffer[index].view(size, -1)[shared.me] for buffer in shared.remote]
    finish = functools.partial(_sum_in_rank_order, rows, output.view(-1), shared.me)
    nbytes = shared.local[index].numel() * shared.local[index].element_size()
    return signal_peers(shared.group, "reduce_scatter", nbytes, shared.peers, finish)


def all_gather(shared: HostShared, index: int, input: torch.Tensor) -> comm.Pending:
    """Async: this rank's buffer `index` becomes every member's `input`, in rank order
    (comm.all_gather's result): its own chunk now, the peers' once they have written theirs."""
    size = len(shared.peers) + 1
    mine = shared.local[index].view(size, -1)
    if mine[shared.me].data_ptr() != input.data_ptr():
        mine[shared.me].copy_(input.view(-1))
    moves = [(shared.remote[j][index].view(size, -1)[j], mine[j]) for j, _ in shared.peers]
    finish = functools.partial(_copy_all, moves)
    nbytes = mine.numel() * mine.element_size()
    return signal_peers(shared.group, "all_gather", nbytes, shared.peers, finish)


def signal_peers(group: dist.ProcessGroup | None, op: str, nbytes: int, peers: tuple[tuple[int, int], ...],
                 finish: Callable[[], object]) -> comm.Pending:
    """Async: a one-byte "ready" to and from each of `peers` ((index, global rank) in group order),
    then `finish` on the waiting thread; recorded and timed by comm as `op` of `nbytes`, the bytes
    the collective moves through the shared buffers."""
    def post() -> Pieces:
        ready = torch.ones(1, dtype=torch.uint8)
        moves = [(ready, torch.empty(1, dtype=torch.uint8), peer) for _, peer in peers]
        return Pieces(exchange(moves, group, finish))
    return comm.collective(group, op, nbytes, post)


def _sum_in_rank_order(rows: list[torch.Tensor], out: torch.Tensor, me: int) -> None:
    if len(rows) == 2:  # the point-to-point path's one add: own + received
        torch.add(rows[me], rows[1 - me], out=out)
    else:
        torch.sum(torch.stack(rows), dim=0, out=out)


def _copy_all(moves: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for source, target in moves:
        target.copy_(source)


def _layout(specs: list[tuple[int, torch.dtype]]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for numel, dtype in specs:
        offsets.append(end)
        end += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, max(end, _ALIGN)


def create_unnamed(nbytes: int) -> int | None:
    """This rank's buffer (or a snapshot slot: mshpc/snapshot/exchange.py): a file of SHM_DIR
    without a name (O_TMPFILE), its pages reserved now: tmpfs hands out pages on first touch, and
    one it has no room for then kills the process (SIGBUS) instead of failing here. None when
    SHM_DIR cannot hold it."""
    try:
        fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return fd
    except OSError:
        os.close(fd)
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def identity(fd: int | None) -> dict | None:
    """What a peer needs to open this rank's buffer and know it for what it is."""
    if fd is None:
        return None
    st, folder = os.fstat(fd), os.stat(SHM_DIR)
    return {"boot": _boot_id(), "folder": [folder.st_dev, folder.st_ino], "pid": os.getpid(), "fd": fd,
            "file": [st.st_dev, st.st_ino]}


def map_peer(own: int | None, who: dict, me: dict, nbytes: int) -> mmap.mmap | None:
    """Member `who`'s buffer mapped here (`own`: this rank's own descriptor), or None when it is
    not on this host and folder, or what opens is not its file or not this user's."""
    if own is None and (who["boot"], who["folder"]) != (me["boot"], me["folder"]):
        return None
    try:
        fd = os.open(f"/proc/{who['pid']}/fd/{who['fd']}", os.O_RDWR | os.O_CLOEXEC) if own is None else os.dup(own)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if [st.st_dev, st.st_ino] != who["file"] or st.st_uid != os.geteuid() or st.st_size < nbytes:
            return None
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping stays


def _views(mapped: mmap.mmap, specs: list[tuple[int, torch.dtype]], offsets: list[int]) -> list[torch.Tensor]:
    whole = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the mapping alive
    return [whole[o:o + n * dtype.itemsize].view(dtype) for (n, dtype), o in zip(specs, offsets, strict=True)]

