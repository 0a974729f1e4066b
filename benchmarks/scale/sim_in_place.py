"""mshpc's real supervisor recovering in place among N simulated ranks (issue #38, part 4).

The supervisor is mshpc's own, with `recovery.in_place: true`: its monitor, detection, the
in-place decision (whom to replace, each one's buddy in a ring over nodes among the ranks of the
same tp coordinate, tp = 8 a node), the new generation's rendezvous told to every surviving rank
and the replacement started, and its events. What would run on the nodes is simulated, as in
sim_nodes.py: one coroutine per node of 8 ranks speaks the node-level heartbeat protocol (hello,
"started", one beats batch a second). At the fault one rank ends (its node says "closed"); a
simulated node answers each rank's rejoin message as a rank does once it has restored its
snapshot (a new "started"), and the node the supervisor names brings the replacement up (its
hello, then "started"). The ranks' own work in a generation (init_process_group on the survivor's
store, the groups, the restore) is measured with real ranks by tests/faults/test_in_place.py and
benchmarks/chaos.py; its store traffic at scale by rendezvous_scale.py.

    .venv/bin/python benchmarks/scale/sim_in_place.py [--n 16 64 512 2048 4096 12288]

One JSON line per figure and N: the decision (the failure's detection to the ranks being told),
the generation (told to every rank having said "started" again), and the whole recovery seen by
the supervisor (detection to rank 0's first step); the checks say who was replaced and whose
snapshot it takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from mshpc.bench import harness
from mshpc.config import ParallelConfig, RecoveryConfig, SupervisorConfig
from mshpc.events import EVENTS_FILE
from mshpc.launch.monitor import RankState
from mshpc.launch.node_relay import closed_message, line, node_hello, rank_envelope
from mshpc.launch.recovery import NodePool
from mshpc.launch.supervisor import Supervisor

NODE_SIZE = 8
INTERVAL_S, STEP_S = 1.0, 0.5  # the beat; a simulated step
FAULT_AT_S = 15.0  # after the nodes start: every one connected and beating (at 12,288 ranks: more, see main)
FINISH_AFTER_S = 10.0  # the ranks exit "ok" this long after the recovery, and the run ends


class Node:
    """One node's relay and its ranks; `lost` is the rank that ends at the fault."""

    def __init__(self, host: str, ranks: list[int], lost: int) -> None:
        self.host, self.ranks, self.lost = host, ranks, lost
        self.started: dict[int, int] = {}  # rank -> the step it (re)started from
        self.writer: asyncio.StreamWriter | None = None
        self.t0 = time.monotonic()

    def step(self) -> int:
        return int((time.monotonic() - self.t0) / STEP_S)

    def send(self, messages: list[dict[str, Any]]) -> None:
        assert self.writer is not None
        self.writer.write(b"".join(line(m) for m in messages))

    def say_started(self, rank: int, hello: bool = False) -> None:
        step = self.step()
        self.started[rank] = step
        first = [rank_envelope(rank, {"type": "hello", "token": TOKEN[0], "rank": rank, "host": self.host,
                                      "pid": None, "coords": None})] if hello else []
        self.send([*first, rank_envelope(rank, {"type": "started", "start_step": step})])

    def beats(self) -> dict[str, Any]:
        step = self.step()
        entries = [{"phase": "step", "step": step, "phase_s": 0.1, "medians": {"step": STEP_S}, "counts": {},
                    "last": None, "rank": r, "age_s": 0.0} for r in self.started]
        return {"type": "beats", "beats": entries}


TOKEN = [""]


async def run_node(address: tuple[str, int], node: Node, done: asyncio.Event) -> None:
    reader, node.writer = await asyncio.open_connection(*address)
    node.send([node_hello(TOKEN[0], node.host, os.getpid())])
    for r in node.ranks:
        node.say_started(r, hello=True)
    listen = asyncio.ensure_future(answer(reader, node))
    fired = False
    while not done.is_set():
        if not fired and node.lost in node.started and time.monotonic() - node.t0 > FAULT_AT_S:
            fired = True
            del node.started[node.lost]
            node.send([closed_message(node.lost, time.time())])
        node.send([node.beats()])
        await asyncio.sleep(INTERVAL_S)
    node.send([rank_envelope(r, {"type": "exit", "how": "ok", "code": None, "start_step": 0}) for r in node.started])
    await node.writer.drain()
    listen.cancel()
    node.writer.transport.abort()


async def answer(reader: asyncio.StreamReader, node: Node) -> None:
    """A rank told to rejoin restores and says "started" again, as the train loop does."""
    while raw := await reader.readline():
        message = json.loads(raw)
        if message.get("type") == "rejoin" and message["rank"] in node.started:
            node.say_started(message["rank"])


async def run_nodes(address: tuple[str, int], nodes: dict[str, Node], done: asyncio.Event) -> None:
    await asyncio.gather(*(run_node(address, n, done) for n in nodes.values()))


def revive(nodes: dict[str, Node], rank: int, host: str, done: asyncio.Event) -> None:
    """A replacement comes up on `host` (its hello, then "started"); then every rank finishes."""
    node = nodes[host]
    node.ranks.append(rank)
    node.say_started(rank, hello=True)
    asyncio.get_running_loop().call_later(FINISH_AFTER_S, done.set)


class SimNodes:
    """The attempt's nodes, the supervisor's `Ranks` and `Replaceable`: in a thread of this
    process (the test) or a process of their own (the benchmark: the supervisor's CPU is then its
    own, as the real nodes' is), told of a replacement on its stdin."""

    def __init__(self, hosts: list[str], env: dict[str, str], lost: int, process: bool) -> None:
        host, port = env["MSHPC_SUPERVISOR"].rsplit(":", 1)
        spec = {"address": [host, int(port)], "token": env["MSHPC_SUPERVISOR_TOKEN"], "hosts": hosts, "lost": lost}
        self.proc: subprocess.Popen[str] | None = None
        self.thread: threading.Thread | None = None
        if process:
            self.proc = subprocess.Popen([sys.executable, __file__, "--nodes", json.dumps(spec)], stdin=subprocess.PIPE,
                                         text=True)
            return
        TOKEN[0] = spec["token"]
        self.nodes = {h: Node(h, list(range(i * NODE_SIZE, (i + 1) * NODE_SIZE)), lost) for i, h in enumerate(hosts)}
        self.loop = asyncio.new_event_loop()
        self.done = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, daemon=True,
                                       args=(run_nodes((host, int(port)), self.nodes, self.done),))
        self.thread.start()

    def alive(self) -> bool:
        return self.proc.poll() is None if self.proc is not None else self.thread is not None and self.thread.is_alive()

    def update(self, states: dict[int, RankState]) -> None:
        if not self.alive():
            for s in states.values():
                s.exited_at = s.exited_at or time.time()

    def request_stop(self) -> None:
        self.stop(0.0)

    def stop(self, grace_s: float) -> list[int]:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
            self.proc.wait(timeout=30)
        elif self.thread is not None:
            self.loop.call_soon_threadsafe(self.done.set)
            self.thread.join(30)
        return []

    def kill(self, rank: int) -> None:
        pass  # its node already said it ended

    def replace(self, rank: int, env: dict[str, str]) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"rank": rank, "host": env["MSHPC_NODE"]}) + "\n")
            self.proc.stdin.flush()
        else:
            self.loop.call_soon_threadsafe(revive, self.nodes, rank, env["MSHPC_NODE"], self.done)


def _nodes_main(spec_json: str) -> None:
    """The nodes' own process: until SIGTERM or the end after a replacement, which its stdin names."""
    import signal

    spec = json.loads(spec_json)
    TOKEN[0] = spec["token"]
    hosts = spec["hosts"]
    nodes = {h: Node(h, list(range(i * NODE_SIZE, (i + 1) * NODE_SIZE)), spec["lost"]) for i, h in enumerate(hosts)}

    async def main() -> None:
        loop, done = asyncio.get_running_loop(), asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, done.set)

        def read_stdin() -> None:
            for raw in sys.stdin:
                word = json.loads(raw)
                loop.call_soon_threadsafe(revive, nodes, word["rank"], word["host"], done)
        threading.Thread(target=read_stdin, daemon=True).start()
        await run_nodes(tuple(spec["address"]), nodes, done)

    asyncio.run(main())


def supervise(world: int, run_dir: Path, lost: int, process: bool = False) -> list[dict[str, Any]]:
    nodes = world // NODE_SIZE
    supervisor = SupervisorConfig(heartbeat_interval_s=INTERVAL_S, timeout_floor_s=60.0, setup_timeout_s=600.0,
                                  max_restarts=3, stop_grace_s=5.0)
    hosts = [f"node{i:05d}" for i in range(nodes)]
    sup = Supervisor(world, NodePool(hosts, nodes, supervisor.evict_after),
                     lambda attempt, active, env: SimNodes(active, env, lost, process), "127.0.0.1",
                     supervisor=supervisor, spare_nodes=0, run_dir=run_dir, checkpoints=run_dir / "checkpoints",
                     recovery=RecoveryConfig(in_place=True), parallel=ParallelConfig(dp=nodes, tp=NODE_SIZE))
    sup.run()
    return [json.loads(x) for x in (run_dir / EVENTS_FILE).read_text().splitlines() if x.strip()]


def figures(world: int, lost: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    one = {e["kind"]: e for e in events}
    if "recover_in_place" not in one:
        raise SystemExit(f"no recovery in place at N={world}: {one.get('in_place_refused', one.get('run_end'))}")
    detected, told, ready, back = (one[k] for k in ("failure_detected", "recover_in_place", "generation_ready",
                                                    "recovered"))
    replaced = told["replaced"][0]
    return {"in_place_decision_s": told["time"] - detected["time"], "generation_ready_s": ready["ready_s"],
            "detection_to_first_step_s": back["time_to_recover_s"],
            "checks": {"replaced": replaced["rank"] == lost, "buddy": replaced["buddy"],
                       "buddy_on_next_node": replaced["buddy"] == (lost + NODE_SIZE) % world,
                       "outcome": one["run_end"]["outcome"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[16, 64, 512, 2048, 4096, 12288])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nodes:
        _nodes_main(args.nodes)
        return
    if args.one:
        global FAULT_AT_S
        FAULT_AT_S += args.one / 500  # every rank started first: the nodes connect 12,288 ranks in seconds here
        with tempfile.TemporaryDirectory(prefix="sim_in_place_") as tmp:
            lost = args.one // 2 + 3  # a rank in the middle of the job
            events = supervise(args.one, Path(tmp) / "run", lost, process=True)
            print(json.dumps(figures(args.one, lost, events)), flush=True)
        return
    for n in args.n:
        if n % NODE_SIZE:
            sys.exit(f"sim_in_place: N={n} is not a whole number of {NODE_SIZE}-rank nodes")
        done = subprocess.run([sys.executable, __file__, "--one", str(n)], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"sim_in_place: N={n} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        checks = result.pop("checks")
        for metric, value in result.items():
            harness.emit(harness.record("scale_in_place", metric, value, "s", n=n, checks=checks,
                                        load_avg=harness.load_average()))


if __name__ == "__main__":
    main()
