"""Heartbeats per node: real rank processes (Heartbeat with a relay plan) on two simulated nodes,
each node's first rank starting the real relay process, against a real Monitor. One connection
per node reaches the monitor, every rank is known at per-rank precision, and a rank killed or
frozen is that rank only: its peers on the node go on beating. (Here, not in unit/: rank processes.)"""

import os
import signal
import subprocess
import sys
import time

import pytest
from support.waiting import wait_until

from mshpc.bench.processes import children
from mshpc.launch.monitor import Monitor

INTERVAL_S = 0.1
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE

RANK = f"""
import sys, time
from mshpc.launch.env import supervisor_link
from mshpc.launch.heartbeat import Heartbeat, RelayPlan
from mshpc.save_schedule import SaveSchedule
rank, node, start = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
link = supervisor_link()
with Heartbeat(link, {{"rank": rank, "host": node, "coords": "(dp=0, tp=0, pp=0)"}}, {INTERVAL_S}, SaveSchedule(0, 100),
               relay=RelayPlan(node, start)) as beat:
    beat.phase("step", 0)
    time.sleep(60)
"""


def node_connections(monitor: Monitor) -> int:
    """How many connections the monitor serves for node relays (its loop's own bookkeeping)."""
    return sum(1 for key in monitor._selector.get_map().values() if getattr(key.data, "host", None) is not None)


@pytest.fixture
def world():
    monitor = Monitor(WORLD, "tok")
    env = {**os.environ, "MSHPC_SUPERVISOR": f"127.0.0.1:{monitor.port}", "MSHPC_SUPERVISOR_TOKEN": "tok"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), f"node{r // PER_NODE}",
                               "1" if r % PER_NODE == 0 else "0"], env=env, stderr=subprocess.PIPE)
             for r in range(WORLD)]
    try:
        yield monitor, procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
        monitor.close()


def test_ranks_report_through_one_connection_per_node_and_a_lost_rank_is_that_rank_only(world):
    monitor, procs = world
    wait_until(lambda: all(s.step == 0 and s.host is not None for s in monitor.ranks.values()), 60)  # torch imports on a busy machine
    assert node_connections(monitor) == NODES
    assert {s.host for s in monitor.ranks.values()} == {"node0", "node1"}
    assert {s.pid for s in monitor.ranks.values()} == {p.pid for p in procs}
    assert len(children(procs[0].pid)) == 1  # its relay

    for relay in children(procs[0].pid):  # Slurm signals every process of a step: the relay stays
        os.kill(relay, signal.SIGTERM)
        os.kill(relay, signal.SIGUSR2)
    procs[0].kill()  # the rank that started node0's relay: the relay outlives it
    procs[3].send_signal(signal.SIGSTOP)  # frozen: silent, its connection open
    wait_until(lambda: monitor.ranks[0].closed_at is not None, 10)
    time.sleep(10 * INTERVAL_S)
    now = time.monotonic()
    silent = {r for r, s in monitor.ranks.items() if s.silent_s(now, now) > 5 * INTERVAL_S}
    assert silent == {0, 3}
    assert [r for r, s in monitor.ranks.items() if s.closed_at is not None] == [0]
    procs[3].send_signal(signal.SIGCONT)

    monitor.request_dumps(10)  # through the relays, to every live rank
    assert all(monitor.ranks[r].dump is not None for r in range(1, WORLD))
    assert "Thread" in monitor.ranks[1].dump["stacks"]
