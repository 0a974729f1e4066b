"""Bootstrap: turn a `LaunchEnv` into an initialised torch.distributed process group.

MPI launches rendezvous over MPI itself (rank 0 picks a free port and broadcasts it), so
no address or port has to be agreed in advance; Slurm launches derive both from the job.

The store lives on rank 0. torch's store client sleeps about a second after each refused
connection, and ranks routinely start before rank 0 listens (rank 0 is one process among many
importing torch), so a start-up of many ranks paid whole seconds at random; the other ranks now
poll the port every few milliseconds first and connect once it accepts (benchmarks/init_groups.py).
What is left is torch's and the site's: each store connect and accept does a reverse DNS lookup
of the peer (c10d's socket.cpp formats addresses with getnameinfo), on rank 0's store thread one
after another, and a lost reply costs the resolver's timeout, 5 s by default, for every rank
(docs/benchmarks/rendezvous_cpu2_2026-12-04.md; benchmarks/store_connect.py).

gloo connects lazily (`connect_lazily`): a group's creation publishes this rank's address once,
and a pair of ranks connects, one store read, on its first message. Eagerly, every member of
every group read every other member's address and connected to it at creation, 2(N-1) store
operations and N-1 connections per rank for the world group alone (MegaScale sec. 3.5's O(n)
start-up); lazily a rank's start-up costs O(1) store operations, the peers its collectives'
algorithms talk to (ring neighbours). A lazy connect blocks the posting call until the peer
touches the same pair of the same group, so point-to-point traffic that ranks post in different
orders over several groups must connect first (parallel.pipeline.build_links does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mshpc.errors import LaunchError
from mshpc.launch.env import LaunchEnv, check_world
from mshpc.launch.ports import free_port

log = logging.getLogger(__name__)

SLURM_PORT_BASE = 20000  # job-derived ports land in [20000, 40000)
PROOF_KEY = "mshpc/store-proof"
TRUST_WAIT_S = 60.0  # for a reached store to answer and show its proof
STORE_POLL_S = 0.01  # how often a rank looks for rank 0's store before connecting to it
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"  # torch reads it at each gloo group's creation


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: str
    backend: str
    launcher: str


def pick_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _mpi_rendezvous(env: LaunchEnv) -> tuple[LaunchEnv, str, int]:
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchError("launched by MPI but mpi4py is not installed (pip install mpi4py)") from None
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    addr_port = (socket.gethostname(), free_port()) if comm.Get_rank() == 0 else None
    addr, port = comm.bcast(addr_port, root=0)
    env = dataclasses.replace(
        env, rank=comm.Get_rank(), world_size=comm.Get_size(),
        local_rank=local.Get_rank(), local_world_size=local.Get_size(),
    )
    local.Free()
    return env, addr, port


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist, expanded by `scontrol show hostnames`."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise LaunchError(f"cannot expand Slurm nodelist {nodelist!r} with scontrol: {exc}") from None
    return out.split()[0]


class StoreUnavailable(RuntimeError):
    """Rank 0 cannot serve the rendezvous store (its port is taken), or the store a rank reached
    is not this job's: not the config's fault, so not a user error (exit 2, never requeued). The
    next attempt's store has another port (a new supervisor token, a new free port)."""


def slurm_port(job_id: int, secret: str | None) -> int:
    """The store's port under Slurm when MASTER_PORT is not set: every rank computes it alike
    from the job and the attempt's secret (the supervisor's token, in the ranks' environment,
    which other users cannot read), so another user cannot bind it ahead of rank 0. Without a
    supervisor, from the job id alone, as before."""
    key = f"{secret}/{job_id}" if secret else str(job_id)
    return SLURM_PORT_BASE + int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 20000


def _address(env: LaunchEnv, secret: str | None) -> tuple[LaunchEnv, str, int]:
    if env.launcher == "mpi":
        return _mpi_rendezvous(env)
    if env.launcher == "slurm":
        assert env.slurm is not None
        addr = env.master_addr or first_host(env.slurm.nodelist)
        port = env.master_port or slurm_port(env.slurm.job_id, secret)
        return env, addr, port
    assert env.master_addr is not None and env.master_port is not None
    return env, env.master_addr, env.master_port


def bind_address(addr: str, all_local: bool) -> str:
    """The interface rank 0's store listens on: the one `addr` (the name every rank connects to)
    names here; loopback for a local run. A name that resolves to loopback here while ranks on
    other nodes must reach it (Debian's /etc/hosts maps the host's own name to 127.0.1.1) leaves
    no single interface to choose: then every interface, as torch does."""
    try:
        ip = str(socket.getaddrinfo(addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise LaunchError(f"the rendezvous address {addr!r} does not resolve to an IPv4 address ({exc})") from None
    return "0.0.0.0" if ipaddress.ip_address(ip).is_loopback and not all_local else ip


def wait_listening(addr: str, port: int, timeout_s: float) -> None:
    """Return once something accepts TCP connections on addr:port (the probe hangs up at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LaunchError(f"no rendezvous store answers on {addr}:{port} after {timeout_s:.0f} s "
                                  f"({exc}); is rank 0 running?") from None
            time.sleep(STORE_POLL_S)


def listen_ipv4(host: str, port: int, world_size: int) -> int:
    """A listening IPv4 socket on `host`'s interface, handed to TCPStore as a descriptor it owns.
    torch's own is dual-stack, so rank 0 sees each peer as ::ffff:a.b.c.d, which /etc/hosts never
    lists, and names it by a reverse DNS query on the store's one thread before serving it: 2
    queries per rank there, one after another (a lost reply stalls everyone 5 s). A plain IPv4
    peer resolves from /etc/hosts; the clients' own lookups stay, each on its own rank."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StoreUnavailable(f"rank 0 cannot serve the rendezvous store on {host}:{port}: {exc.strerror} "
                               "(another job or user holds it; the next attempt takes another port)") from None
    sock.listen(max(world_size, socket.SOMAXCONN))  # every rank connects at once
    return sock.detach()  # TCPStore closes it


def store_proof(secret: str, port: int) -> str:
    """What rank 0 writes into its store to show it holds the job's secret: an HMAC of the port
    under the attempt's token, worthless to anyone who reads it (only this attempt's store, on
    this port, which rank 0 holds, carries it)."""
    return hmac.new(secret.encode(), f"mshpc-store/{port}".encode(), hashlib.sha256).hexdigest()


def connect_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float,
                  secret: str | None = None, bind_host: str = "0.0.0.0", store_rank: int = 0) -> dist.TCPStore:
    """Rank `store_rank` (0, or a surviving rank in a generation after a recovery in place) serves
    the store on `bind_host`; the others connect as soon as it listens, and with a `secret` trust
    it only once it shows the proof (`store_proof`): a listener another user put on the port
    cannot. No rank waits for the others here: the process group's own connections do that.
    torch's TCPStore itself has no access control: anyone who reaches it may read and write keys
    (docs/security.md says what that leaves)."""
    timeout = timedelta(seconds=timeout_s)
    if rank == store_rank:
        store = dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listen_ipv4(bind_host, port, world_size))
        if secret:
            store.set(PROOF_KEY, store_proof(secret, port))
        return store
    wait_listening(addr, port, timeout_s)
    quick = timedelta(seconds=min(timeout_s, TRUST_WAIT_S))  # a listener that is no store must not hold us for long
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=quick)
        if secret:
            store.wait([PROOF_KEY], quick)
            if not hmac.compare_digest(store.get(PROOF_KEY), store_proof(secret, port).encode()):
                raise StoreUnavailable(f"the rendezvous store at {addr}:{port} does not hold this job's secret: "
                                       "not this job's store (another user's listener on its port?)")
    except StoreUnavailable:
        raise
    except RuntimeError as exc:  # torch's DistError and its kin: a listener that does not speak the store's protocol
        raise StoreUnavailable(f"the listener at {addr}:{port} is not this job's rendezvous store within "
                               f"{quick.total_seconds():g} s ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    store.set_timeout(timeout)
    return store


def connect_lazily() -> None:
    """Make every gloo group created from now on in this process connect its pairs on first use
    (torch has no per-group option for it: the gloo backend ignores pg_options). A site that sets
    TORCH_GLOO_LAZY_INIT=0 itself keeps eager connections: the escape hatch if a lazy pair misbehaves."""
    os.environ.setdefault(GLOO_LAZY_INIT, "1")


def init_distributed(env: LaunchEnv, timeout_s: float = 600.0) -> DistInfo:
    """Create the default process group for this rank; every rank of the job must call it."""
    backend = pick_backend()
    connect_lazily()  # gloo groups only; NCCL communicators are lazy already
    timeout = timedelta(seconds=timeout_s)
    if env.launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        secret = env.supervisor.token if env.supervisor is not None else None
        env, addr, port = _address(env, secret)
        check_world(env, env.world_size)
        serves = env.rank == env.store_rank  # rank 0, or after a recovery in place a survivor
        bind_host = bind_address(addr, env.local_world_size >= env.world_size) if serves else ""
        store = connect_store(addr, port, env.rank, env.world_size, timeout_s, secret, bind_host, env.store_rank)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    log.info("rank %d/%d on %s: %s via %s", env.rank, env.world_size, env.node, backend, env.launcher)
    return DistInfo(
        rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
        local_world_size=env.local_world_size, node=env.node, backend=backend, launcher=env.launcher,
    )


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
