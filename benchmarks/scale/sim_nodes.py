"""mshpc's real supervisor against N simulated NODES, with faults (issue #20, part 2).

The supervisor side is mshpc's own, unchanged: `Supervisor.run()` with its monitor, detection,
hang report, classification, eviction, restarts and events.jsonl. Only what would run on the
other nodes is simulated: each node is a coroutine that speaks the node-level heartbeat protocol
as mshpc/launch/node_relay.py does (a "node" hello with the token, each rank's hello and
"started", one "beats" batch per interval, dumps on request, "exit"/"closed" at the end), for 8
ranks that step every `step_s`. The nodes run in one process: a thread of the supervisor's
(`SimNodes(..., process=False)`, the tests) or a process of their own (the benchmark, so that
the supervisor's CPU and memory are its own).

One supervised run goes through every fault, one per attempt, each rank or node drawn at random
(`--seed`): a silent rank (frozen: its beats stop, its peers wait in the next collective), a
crashed node (its connection drops), a stuck collective (a rank beats on but never enters the
collective its peers wait in), then a straggler (3x slower steps) in an attempt that finishes.
The first three are each blamed on their node, which is evicted (`evict_after=1`) for a spare.

    .venv/bin/python benchmarks/scale/sim_nodes.py [--n 8 64 512 2048 4096 12288] [--measure-s 30]

prints one JSON line per figure and N (supervisor CPU in cores at 1 Hz beats, its peak RSS,
time to register every rank, time to detect the silent rank past its timeout, time from the
detection to the hang report (dumps included) and to write it, time to decide the eviction), then
each figure's growth exponent (log-log slope).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mshpc.bench import harness
from mshpc.config import Config, RunConfig, SupervisorConfig, TrainConfig
from mshpc.events import EVENTS_FILE
from mshpc.launch.monitor import RankState
from mshpc.launch.node_relay import closed_message, line, node_hello, rank_envelope
from mshpc.launch.recovery import NodePool
from mshpc.launch.supervisor import Supervisor

NODE_SIZE = 8
FAULTS = ("silent", "crash_node", "stuck", "straggler")  # one per attempt, in this order
FD_MARGIN = 256


@dataclass(frozen=True)
class Fault:
    """One attempt's fault: its kind, the rank (or the node, for crash_node) it hits, and when,
    in seconds after the nodes start."""

    kind: str
    rank: int
    at_s: float


@dataclass(frozen=True)
class Timing:
    interval_s: float = 1.0  # the beat (supervisor.heartbeat_interval_s)
    step_s: float = 0.5  # a simulated step
    fault_at_s: float = 5.0  # after the nodes start
    finish_at_s: float = 3.0  # the clean attempt's ranks exit "ok" this long after they start
    timeout_floor_s: float = 5.0  # supervisor.timeout_floor_s: the silent and stuck hangs' timeout


def draw_faults(world: int, seed: int, timing: Timing, first_at_s: float | None = None) -> list[Fault]:
    """A fault per attempt, on a rank drawn at random (a node, for crash_node)."""
    rng = random.Random(seed)
    ranks = rng.sample(range(world), 3)
    first = timing.fault_at_s if first_at_s is None else first_at_s
    return [Fault("silent", ranks[0], first), Fault("crash_node", ranks[1] // NODE_SIZE, timing.fault_at_s),
            Fault("stuck", ranks[2], timing.fault_at_s), Fault("straggler", rng.randrange(world), 0.0)]


# ---------------------------------------------------------------- one simulated node


@dataclass
class _Clock:
    start: float = field(default_factory=time.monotonic)
    fired_wall: float | None = None  # when the fault began (time.time), for the figures

    def now(self) -> float:
        return time.monotonic() - self.start


def _tp_group(node: int) -> str:
    """The node's tp group, named as mshpc/parallel/comm.py names a group: its ranks as JSON."""
    return json.dumps(list(range(node * NODE_SIZE, (node + 1) * NODE_SIZE)), separators=(", ", ": "))


class _Rank:
    def __init__(self, rank: int, fault: Fault, timing: Timing, clock: _Clock, group: str) -> None:
        self.rank, self.fault, self.timing, self.clock, self.group = rank, fault, timing, clock, group
        self.step_s = timing.step_s * (3 if fault.kind == "straggler" and fault.rank == rank else 1)
        self.medians = {"data": 0.01 * self.step_s, "step": self.step_s}
        self.hit = fault.rank == rank and fault.kind in ("silent", "stuck")
        self.hangs = fault.kind in ("silent", "stuck")

        # the constant parts of its messages, serialized once: 1,536 nodes' beats every second
        # must fit in one process beside the supervisor on 2 cores
        self._medians_json, self._group_json = json.dumps(self.medians), json.dumps(group)

    def where(self) -> tuple[int, float, int]:
        """(step, seconds in its phase, world collectives entered). Two world collectives and one
        on the node's tp group per step; in the hang, everyone waits in the first world collective
        of the step the fault began in, which the missing rank never entered."""
        now = self.clock.now()
        hung = self.hangs and self.clock.fired_wall is not None
        if hung:
            step, phase_s = int(self.fault.at_s / self.step_s), now - self.fault.at_s
        else:
            step, phase_s = int(now / self.step_s), now % self.step_s
        return step, phase_s, 2 * step + (0 if hung and self.hit else 1)

    def beat(self) -> dict[str, Any]:
        """Its beat, as Heartbeat._beat shapes it."""
        step, phase_s, world = self.where()
        return {"type": "beat", "phase": "step", "step": step, "phase_s": phase_s, "medians": self.medians,
                "counts": {"world": world, self.group: step}, "last": [world, "world", "all_reduce", 4096]}

    def beat_json(self) -> str:
        """beat_entry(rank, beat(), 0.0) as JSON, built from the parts (the test checks they agree)."""
        step, phase_s, world = self.where()
        return (f'{{"phase":"step","step":{step},"phase_s":{phase_s!r},"medians":{self._medians_json},'
                f'"counts":{{"world":{world},{self._group_json}:{step}}},"last":[{world},"world","all_reduce",4096],'
                f'"rank":{self.rank},"age_s":0.0}}')

    def dump(self) -> dict[str, Any]:
        counts = self.beat()["counts"]
        return {"type": "dump", "stacks": f"Thread 0x1 (most recent call first):\n  <simulated rank {self.rank}>\n",
                "records": [[counts["world"], "world", "all_reduce", 4096]], "counts": counts}


def beats_line(ranks: list[_Rank]) -> bytes:
    """beats_message of these ranks' beats, as one line."""
    return ('{"type":"beats","beats":[' + ",".join(r.beat_json() for r in ranks) + "]}\n").encode()


async def run_node(address: tuple[str, int], token: str, host: str, node: int, fault: Fault, timing: Timing,
                   clock: _Clock, stop: asyncio.Event) -> None:
    """One node's relay and its 8 ranks, until `stop`, the fault ends the node, or its ranks finish."""
    try:
        reader, writer = await asyncio.open_connection(*address)
    except OSError:
        return
    group = _tp_group(node)
    ranks = [_Rank(r, fault, timing, clock, group) for r in range(node * NODE_SIZE, (node + 1) * NODE_SIZE)]
    hello = [line(node_hello(token, host, os.getpid()))]
    for r in ranks:
        hello += [line(rank_envelope(r.rank, {"type": "hello", "token": token, "rank": r.rank, "host": host,
                                              "pid": None, "coords": f"(dp={node}, tp={r.rank % NODE_SIZE}, pp=0)"})),
                  line(rank_envelope(r.rank, {"type": "started", "start_step": 0}))]
    writer.write(b"".join(hello))
    answers = asyncio.ensure_future(_answer_dumps(reader, writer, ranks))
    await asyncio.sleep(random.random() * timing.interval_s)  # nodes beat out of step, as real ones do
    try:
        await _beat_until_done(writer, node, ranks, fault, timing, clock, stop)
    finally:
        answers.cancel()
        writer.transport.abort()  # a crashed node's connection drops; the others end anyway


async def _beat_until_done(writer: asyncio.StreamWriter, node: int, ranks: list[_Rank], fault: Fault, timing: Timing,
                           clock: _Clock, stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = clock.now()
        if fault.kind != "straggler" and now >= fault.at_s and clock.fired_wall is None:
            clock.fired_wall = time.time() - (now - fault.at_s)  # the first node to see it starts it for all
        if fault.kind == "crash_node" and fault.rank == node and clock.fired_wall is not None:
            return
        silent = {fault.rank} if fault.kind == "silent" and clock.fired_wall is not None else set()
        if silent and ranks[0].rank <= fault.rank < ranks[0].rank + NODE_SIZE and now - fault.at_s < timing.interval_s:
            silent = set()  # its last beat: the hung step has begun for it too
        writer.write(beats_line([r for r in ranks if r.rank not in silent]))
        if fault.kind == "straggler" and now >= timing.finish_at_s:
            writer.write(b"".join(line(rank_envelope(r.rank, {"type": "exit", "how": "ok", "code": None,
                                                                "start_step": 0})) for r in ranks)
                         + b"".join(line(closed_message(r.rank, time.time())) for r in ranks))
            await writer.drain()
            return
        await asyncio.sleep(timing.interval_s)  # not wait_for(stop): a task per node and beat is too dear at 1,536


async def _answer_dumps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ranks: list[_Rank]) -> None:
    """A relay passes a dump request to its ranks; a frozen one does not answer."""
    while raw := await reader.readline():
        if json.loads(raw).get("type") == "dump":
            writer.write(b"".join(line(rank_envelope(r.rank, r.dump())) for r in ranks
                                  if not (r.hit and r.fault.kind == "silent")))
        await writer.drain()


async def run_nodes(address: tuple[str, int], token: str, hosts: Sequence[str], fault: Fault, timing: Timing,
                    clock: _Clock, stop: asyncio.Event) -> None:
    await asyncio.gather(*(run_node(address, token, h, i, fault, timing, clock, stop) for i, h in enumerate(hosts)))


# ---------------------------------------------------------------- the nodes, as the supervisor's launcher sees them


class SimNodes:
    """One attempt's simulated nodes, as the supervisor's `Ranks`: in a thread of this process or
    a process of their own. When they have ended, every rank that said nothing ended with them
    (as an srun step's ranks do, mshpc/launch/slurm_supervisor.py)."""

    def __init__(self, hosts: list[str], env: dict[str, str], fault: Fault, timing: Timing, process: bool) -> None:
        host, port = env["MSHPC_SUPERVISOR"].rsplit(":", 1)
        self.address, self.token = (host, int(port)), env["MSHPC_SUPERVISOR_TOKEN"]
        self.connect_at = time.monotonic()  # when the nodes begin to connect, all at once
        self.registered_s: float | None = None  # from then until the supervisor knew every rank
        self.clock = _Clock()
        self.ended_at: float | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        if process:
            spec = json.dumps({"address": self.address, "token": self.token, "hosts": hosts, "fault": asdict(fault),
                               "timing": asdict(timing)})
            self._proc = subprocess.Popen([sys.executable, __file__, "--nodes", spec], stdout=subprocess.PIPE, text=True)
            assert self._proc.stdout is not None
            said = self._proc.stdout.readline()  # after its start-up (CLOCK_MONOTONIC is the machine's)
            self.connect_at = json.loads(said)["connect_at"] if said else self.connect_at
        else:
            self._loop: asyncio.AbstractEventLoop | None = None
            self._stop: asyncio.Event | None = None
            ready = threading.Event()

            async def nodes() -> None:
                self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
                ready.set()
                await run_nodes(self.address, self.token, hosts, fault, timing, self.clock, self._stop)

            self._thread = threading.Thread(target=asyncio.run, args=(nodes(),), daemon=True)
            self._thread.start()
            ready.wait(10)

    def done(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is not None
        assert self._thread is not None
        return not self._thread.is_alive()

    def fired_wall(self) -> float | None:
        """When the fault began (the nodes' process prints it)."""
        if self._proc is not None and self.clock.fired_wall is None and self.done():
            assert self._proc.stdout is not None
            said = json.loads(self._proc.stdout.read() or "{}")
            self.clock.fired_wall = said.get("fired_wall")
        return self.clock.fired_wall

    def update(self, states: dict[int, RankState]) -> None:
        if self.registered_s is None and all(s.host is not None for s in states.values()):
            self.registered_s = time.monotonic() - self.connect_at
        if not self.done():
            return
        self.ended_at = self.ended_at or time.time()
        for s in states.values():
            if s.exited_at is None:
                s.exited_at = self.ended_at

    def request_stop(self) -> None:
        self.stop(0.0)

    def stop(self, grace_s: float) -> list[int]:
        if self._proc is not None:
            if self._proc.poll() is None:
                assert self._proc.stdin is None
                self._proc.terminate()  # its handler prints when the fault began, then exits
            self._proc.wait(timeout=30)
            self.fired_wall()
        elif self._thread is not None and self._loop is not None and self._stop is not None:
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)
        return []


def _nodes_main(spec_json: str) -> None:
    """The nodes' own process: runs until SIGTERM, then prints when the fault began."""
    import signal

    spec = json.loads(spec_json)
    clock = _Clock()

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await run_nodes(tuple(spec["address"]), spec["token"], spec["hosts"], Fault(**spec["fault"]),
                        Timing(**spec["timing"]), clock, stop)

    _raise_nofile(len(spec["hosts"]) + FD_MARGIN)
    print(json.dumps({"connect_at": time.monotonic()}), flush=True)
    asyncio.run(main())
    print(json.dumps({"fired_wall": clock.fired_wall}), flush=True)


# ---------------------------------------------------------------- one supervised run through every fault


@dataclass
class Outcome:
    """What one supervised run did: the supervisor's exit code, its events, and per attempt the
    nodes' figures (registration time, when the fault began)."""

    code: int
    faults: list[Fault]
    events: list[dict[str, Any]]
    attempts: list[SimNodes]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


def supervise(world: int, run_dir: Path, seed: int = 0, timing: Timing = Timing(), process: bool = False,
              first_fault_at_s: float | None = None) -> Outcome:
    """mshpc's Supervisor over `world` simulated ranks on nodes of 8, with 3 spares: one fault per
    attempt (FAULTS), each node blamed evicted at once; returns what happened."""
    if world % NODE_SIZE:
        raise SystemExit(f"sim_nodes: N={world} is not a whole number of {NODE_SIZE}-rank nodes")
    nodes = world // NODE_SIZE
    faults = draw_faults(world, seed, timing, first_fault_at_s)
    cfg = Config(run=RunConfig(name=run_dir.name, out_dir=str(run_dir.parent)), train=TrainConfig(spare_nodes=3),
                 supervisor=SupervisorConfig(heartbeat_interval_s=timing.interval_s, timeout_floor_s=timing.timeout_floor_s,
                                             setup_timeout_s=60.0, max_restarts=3, stop_grace_s=5.0, evict_after=1))
    hosts = [f"node{i:05d}" for i in range(nodes + 3)]
    attempts: list[SimNodes] = []

    def start(attempt: int, active: list[str], env: dict[str, str]) -> SimNodes:
        attempts.append(SimNodes(active, env, faults[attempt], timing, process))
        return attempts[-1]

    sup = Supervisor(world, NodePool(hosts, nodes, cfg.supervisor.evict_after), start, "127.0.0.1",
                     supervisor=cfg.supervisor, spare_nodes=cfg.train.spare_nodes, run_dir=run_dir,
                     checkpoints=run_dir / "checkpoints")
    code = sup.run()
    events = [json.loads(x) for x in (run_dir / EVENTS_FILE).read_text().splitlines() if x.strip()]
    return Outcome(code, faults, events, attempts)


# ---------------------------------------------------------------- the benchmark


def _raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if need > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


def largest_world() -> int:
    """One descriptor and one local port per node on each side (the nodes' process, the supervisor)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return min(hard - FD_MARGIN, high - low + 1) * NODE_SIZE


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(world: int, seed: int, measure_s: float) -> dict[str, Any]:
    """One N, in this process (the supervisor's): the run through every fault, with its CPU per
    wall second sampled over `measure_s` of steady 1 Hz beats before the first fault."""
    warmup_s = 10.0 + world / 2000  # every node connected and beating (the nodes' process is slower at 12,288)
    # the product's floor is 60 s; 20 s keeps the run short and stays far above the jitter of one
    # process simulating 1,536 nodes on a shared 2-core machine
    timing = Timing(timeout_floor_s=20.0)
    samples: dict[str, float] = {}

    def sample() -> None:
        time.sleep(warmup_s)
        samples["cpu0"], samples["t0"] = _cpu_s(), time.monotonic()
        time.sleep(measure_s)
        samples["cpu1"], samples["t1"] = _cpu_s(), time.monotonic()

    with tempfile.TemporaryDirectory(prefix="sim_nodes_") as tmp:
        threading.Thread(target=sample, daemon=True).start()
        out = supervise(world, Path(tmp) / "run", seed, timing, process=True, first_fault_at_s=warmup_s + measure_s + 1)
    return _figures(world, out, timing, samples)


def _figures(world: int, out: Outcome, timing: Timing, samples: dict[str, float]) -> dict[str, Any]:
    detected, reports, stopped, evicted = (out.of(k) for k in ("failure_detected", "hang_report", "ranks_stopped",
                                                                "evicted"))
    silent = out.attempts[0]
    fired = silent.fired_wall()
    figures: dict[str, Any] = {
        "supervisor_cpu": (samples["cpu1"] - samples["cpu0"]) / (samples["t1"] - samples["t0"]),
        "supervisor_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "time_to_register_all": max(a.registered_s or math.inf for a in out.attempts),
        "silent_rank_detected_past_timeout": detected[0]["time"] - fired - detected[0]["timeout_s"] if fired else None,
        "hang_report": reports[0]["time"] - detected[0]["time"],  # the dumps' round trip, then the writing
        "hang_report_write": reports[0]["write_s"],
        "eviction_decision": evicted[0]["time"] - stopped[0]["time"],
    }
    checks = {"exit_code": out.code, "detected": [d["failure"] for d in detected], "evicted": len(evicted),
              "silent_named": [m["rank"] for m in reports[0]["missing"]] == [out.faults[0].rank]}
    return {"figures": figures, "checks": checks}


UNITS = {"supervisor_cpu": "core", "supervisor_peak_rss": "MiB", "time_to_register_all": "s",
         "silent_rank_detected_past_timeout": "s", "hang_report": "s", "hang_report_write": "s", "eviction_decision": "s"}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x: the growth exponent (1.0 = linear)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-4)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def emit(metric: str, value: Any, unit: str, n: int | None = None, **extra: Any) -> None:
    harness.emit({"bench": "scale_supervisor", "metric": metric, "value": value, "unit": unit,
                  **({"n": n} if n is not None else {}), **extra})


def _one(world: int, seed: int, measure_s: float) -> None:
    """`--one N`: a fresh process per N, so that its peak RSS is that N's."""
    _raise_nofile(world // NODE_SIZE + FD_MARGIN)
    print(json.dumps(measure(world, seed, measure_s)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8, 64, 512, 2048, 4096, 12288])
    parser.add_argument("--measure-s", type=float, default=30.0, help="seconds of 1 Hz beats the CPU is measured over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nodes", help=argparse.SUPPRESS)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nodes:
        _nodes_main(args.nodes)
        return
    if args.one:
        _one(args.one, args.seed, args.measure_s)
        return
    bad = [n for n in args.n if n % NODE_SIZE or n <= 0]
    if bad:
        sys.exit(f"sim_nodes: N={bad[0]} is not a positive whole number of {NODE_SIZE}-rank nodes")
    if max(args.n) > largest_world():
        sys.exit(f"sim_nodes: N={max(args.n)} is past this machine: the largest N it holds is {largest_world()} "
                 "(RLIMIT_NOFILE hard limit and local port range, one connection per node of 8)")
    rows: dict[str, list[float]] = {k: [] for k in UNITS}
    for n in args.n:
        done = subprocess.run([sys.executable, __file__, "--one", str(n), "--seed", str(args.seed),
                               "--measure-s", str(args.measure_s)], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"sim_nodes: N={n} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        for metric, value in result["figures"].items():
            emit(metric, None if value is None else round(value, 4), UNITS[metric], n,
                 **({"checks": result["checks"]} if metric == "supervisor_cpu" else {}))
            rows[metric].append(value if value is not None else 0.0)
    if len(args.n) > 1:
        for metric, values in rows.items():
            emit(metric + "_growth_exponent", round(slope([float(n) for n in args.n], values), 3), "1", ns=args.n)


if __name__ == "__main__":
    main()
