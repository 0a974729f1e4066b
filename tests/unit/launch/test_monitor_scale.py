"""The heartbeat monitor with many ranks connecting at once (issue #20): a real Monitor, and 256
simulated ranks speaking the heartbeat protocol from one asyncio loop
(benchmarks/scale/sim_peers.py). Every rank registers within 10 s, and a rank that stops beating
stands out from the rest."""

import asyncio
import contextlib
import importlib.util
import threading
import time
from pathlib import Path

from support.waiting import wait_until

from mshpc.launch.monitor import Monitor

SIM_PEERS = Path(__file__).resolve().parents[3] / "benchmarks" / "scale" / "sim_peers.py"
WORLD = 256
SILENT = 77  # says hello and "started", then nothing
INTERVAL_S = 0.2  # the product's beat is 1 s; short here so that silence shows quickly
REGISTER_WITHIN_S = 10.0


def load_sim_peers():
    """benchmarks/ is no package: the simulated ranks are loaded from their file."""
    spec = importlib.util.spec_from_file_location("sim_peers", SIM_PEERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def simulated_ranks(monitor: Monitor, silent: frozenset[int]):
    """WORLD simulated ranks beating at INTERVAL_S in a side thread's event loop, all connecting at
    once; stopped and joined on exit. Yields a list that receives how many connected."""
    sim, ready, connected = load_sim_peers(), threading.Event(), []
    holder = {}

    async def world() -> None:
        holder["loop"], holder["stop"] = asyncio.get_running_loop(), asyncio.Event()
        ready.set()
        connected.append(await sim.run_world("127.0.0.1", monitor.port, "tok", WORLD, holder["stop"],
                                             INTERVAL_S, silent))

    thread = threading.Thread(target=asyncio.run, args=(world(),), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield connected
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(30)


def test_every_rank_registers_within_10_s_when_all_connect_at_once():
    monitor = Monitor(WORLD, "tok")
    try:
        with simulated_ranks(monitor, frozenset()) as connected:
            wait_until(lambda: all(s.host is not None and s.start_step == 0 for s in monitor.ranks.values()),
                       REGISTER_WITHIN_S)
            wait_until(lambda: all(s.step >= 0 for s in monitor.ranks.values()), REGISTER_WITHIN_S)  # beats too
        assert connected == [WORLD]
        assert {s.host for s in monitor.ranks.values()} == {f"node{n:05d}" for n in range(WORLD // 8)}
    finally:
        monitor.close()


def test_a_silent_rank_stands_out_among_256():
    monitor = Monitor(WORLD, "tok")
    try:
        with simulated_ranks(monitor, frozenset({SILENT})):
            wait_until(lambda: all(s.host is not None for s in monitor.ranks.values()), REGISTER_WITHIN_S)
            started = time.monotonic()
            wait_until(lambda: monitor.ranks[SILENT].silent_s(time.monotonic(), started) > 10 * INTERVAL_S, 10)
            now = time.monotonic()
            silent = [r for r, s in monitor.ranks.items() if s.silent_s(now, started) > 5 * INTERVAL_S]
            assert silent == [SILENT]
            assert monitor.ranks[SILENT].closed_at is None  # connected, yet saying nothing: a hang's sign
    finally:
        monitor.close()


def test_closing_the_monitor_ends_every_connection():
    monitor = Monitor(WORLD, "tok")
    with simulated_ranks(monitor, frozenset()):
        wait_until(lambda: all(s.host is not None for s in monitor.ranks.values()), REGISTER_WITHIN_S)
        monitor.close()
        assert all(s.closed_at is not None for s in monitor.ranks.values())
