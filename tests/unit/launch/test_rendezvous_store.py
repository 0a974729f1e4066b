"""Rank 0's rendezvous store listens on a plain IPv4 socket (launch.rendezvous.listen_ipv4), so
its accepts name their peers from /etc/hosts rather than by a reverse DNS query each, on the
interface the ranks use (loopback for a local run); a rank trusts it only once it shows the job's
secret; a port already taken (another user's listener) is not a user error (issue #43, finding 5)."""

import socket
import threading
import time
from pathlib import Path

import pytest
from support.other_user import needs_root, nobody_python

from mshpc.errors import MshpcError
from mshpc.launch.ports import free_port
from mshpc.launch.rendezvous import StoreUnavailable, bind_address, connect_store, slurm_port


def listening(port: int, table: str, on: str | None = None) -> bool:
    """Whether /proc/net/<table> (tcp: IPv4, tcp6: IPv6 and dual-stack) lists a listener on port
    (on the address `on`, as /proc writes it: 0100007F is 127.0.0.1, 00000000 every interface)."""
    rows = Path("/proc/net", table).read_text().splitlines()[1:]
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A"
               and (on is None or r.split()[1].startswith(on + ":")) for r in rows)


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


def test_a_local_runs_store_listens_on_loopback_only():
    assert bind_address("127.0.0.1", all_local=True) == "127.0.0.1"
    assert bind_address("localhost", all_local=False) == "0.0.0.0"  # other nodes must reach it
    port = free_port()
    store = connect_store("127.0.0.1", port, rank=0, world_size=2, timeout_s=30, secret="s", bind_host="127.0.0.1")
    assert listening(port, "tcp", on="0100007F") and not listening(port, "tcp", on="00000000")
    del store


def test_a_slurm_port_is_the_secrets_not_the_job_ids():
    ports = {slurm_port(4242, f"token-{i}") for i in range(50)}
    assert len(ports) > 40 and all(20000 <= p < 40000 for p in ports)
    assert slurm_port(4242, "a") == slurm_port(4242, "a")  # every rank computes the same one
    assert slurm_port(4242, None) == slurm_port(4242, None)


def test_a_rank_trusts_the_store_only_with_the_jobs_secret():
    port = free_port()
    server = connect_store("127.0.0.1", port, rank=0, world_size=2, timeout_s=30, secret="ours")
    got = connect_store("127.0.0.1", port, 1, 2, 30, secret="ours")
    got.set("k", b"v")
    assert server.get("k") == b"v"
    with pytest.raises(StoreUnavailable, match="does not hold this job's secret"):
        connect_store("127.0.0.1", port, 1, 2, 30, secret="another attempt's")


@needs_root
def test_another_users_store_on_the_port_is_not_trusted():
    port = free_port()
    fake = nobody_python(
        "import datetime, time, torch.distributed as dist\n"
        f"s = dist.TCPStore('127.0.0.1', {port}, 2, True, datetime.timedelta(seconds=60), wait_for_workers=False)\n"
        "s.set('mshpc/store-proof', 'made up')\n"
        "print('serving', flush=True); time.sleep(60)\n")
    try:
        assert fake.stdout.readline() == "serving\n"
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port} does not hold this job's secret"):
            connect_store("127.0.0.1", port, 1, 2, 600, secret="ours")
        assert time.monotonic() - start < 30
    finally:
        fake.kill()
        fake.wait()


@needs_root
def test_a_port_another_user_took_first_is_not_a_user_error():
    # issue #43, finding 5: binding the store's port first killed the job as a user error (exit 2),
    # which Slurm's requeue guard never requeues; now the attempt fails and the next takes another port
    port = free_port()
    squatter = nobody_python(
        "import socket, time\n"
        f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
        "print('bound', flush=True); time.sleep(60)\n")
    try:
        assert squatter.stdout.readline() == "bound\n"
        with pytest.raises(StoreUnavailable, match=f"port") as err:
            connect_store("127.0.0.1", port, rank=0, world_size=2, timeout_s=5, bind_host="127.0.0.1")
        assert not isinstance(err.value, MshpcError) and "\n" not in str(err.value)
        assert "the next attempt takes another port" in str(err.value)
    finally:
        squatter.kill()
        squatter.wait()
