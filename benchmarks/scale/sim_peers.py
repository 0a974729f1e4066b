"""The supervisor's heartbeat monitor against N simulated ranks (issue #20, step 1).

N ranks, in nodes of 8, run as coroutines of ONE process and speak the heartbeat protocol as
mshpc/launch/heartbeat.py sends it (hello with the token, "started", a beat every second, a
dump when asked). They all connect at once to a real `Monitor` that runs in ANOTHER process,
so that the supervisor's CPU time (/proc/PID/stat utime+stime) and resident memory (VmRSS) are
its own. Printed per N: the time until every rank is registered, the supervisor's CPU seconds
per wall second over 30 s of 1 Hz beats, its RSS and threads; then the fitted growth exponent
(log-log slope) of CPU against N.

    .venv/bin/python benchmarks/scale/sim_peers.py [--n 512 2048 4096 12288]

The protocol half (`run_world`) is imported by tests/unit/launch/test_monitor_scale.py.

This is the per-rank protocol: what a rank speaks when it has no node relay (supervisor.node_relay
false, or its relay out of reach). With relays, one connection per node: sim_nodes.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

NODE_SIZE = 8  # ranks per node, as on the paper's 8-GPU nodes
REGISTER_WAIT_S = 60.0  # the figures were taken after 60 s
MEASURE_S = 30.0
FD_MARGIN = 64  # the interpreter's own files, the listening socket, the pipes
CLK_TCK = os.sysconf("SC_CLK_TCK")

# ---------------------------------------------------------------- the ranks' side (the protocol)


def hello_message(token: str, rank: int) -> dict[str, Any]:
    """What Heartbeat._connect sends first (start_heartbeat's hello plus the token and pid)."""
    node = rank // NODE_SIZE
    return {"type": "hello", "token": token, "pid": os.getpid(), "rank": rank, "host": f"node{node:05d}",
            "coords": f"(dp={node}, tp={rank % NODE_SIZE}, pp=0)"}


def beat_message(step: int, phase_s: float) -> dict[str, Any]:
    """A beat with every field FIELDS["beat"] checks, in the shapes Heartbeat._beat gives them."""
    return {"type": "beat", "phase": "step", "step": step, "phase_s": phase_s,
            "medians": {"data": 0.01, "step": 0.9}, "counts": {"world": step, "dp": 2 * step},
            "last": [2 * step, "dp", "all_reduce", 4096]}


def dump_message() -> dict[str, Any]:
    return {"type": "dump", "stacks": "Thread 0x0 (most recent call first):\n  <simulated>\n",
            "records": [[0, "world", "all_reduce", 4]], "counts": {"world": 1}}


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message) + "\n").encode()


async def _answer_dumps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Heartbeat._listen's other half: a dump request is answered with a dump."""
    while line := await reader.readline():
        if json.loads(line).get("type") == "dump":
            writer.write(_line(dump_message()))


async def run_peer(host: str, port: int, token: str, rank: int, stop: asyncio.Event,
                   interval_s: float = 1.0, silent: bool = False) -> bool:
    """One rank: hello and "started" at once, then a beat every `interval_s` until `stop`
    (a `silent` rank stays connected and says nothing more, as a hung rank's heartbeat
    thread would if its process were frozen). False when it could not connect."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.write(_line(hello_message(token, rank)) + _line({"type": "started", "start_step": 0}))
    answers = asyncio.ensure_future(_answer_dumps(reader, writer))
    step, started = 0, time.monotonic()
    try:
        while not stop.is_set():
            if not silent:
                writer.write(_line(beat_message(step, time.monotonic() - started)))
            step += 1
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
    finally:
        answers.cancel()
        writer.close()
    return True


async def run_world(host: str, port: int, token: str, world: int, stop: asyncio.Event,
                    interval_s: float = 1.0, silent: frozenset[int] = frozenset()) -> int:
    """All `world` ranks connecting at once; the number that connected, once `stop` is set."""
    peers = [run_peer(host, port, token, r, stop, interval_s, r in silent) for r in range(world)]
    return sum(await asyncio.gather(*peers))


# ---------------------------------------------------------------- descriptors and the machine's limits


def raise_nofile(need: int) -> None:
    """The soft RLIMIT_NOFILE raised to `need` (one descriptor per connection); a one-line
    SystemExit naming the largest N this machine holds when the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if need > hard:
        sys.exit(f"sim_peers: {need} descriptors needed, the hard RLIMIT_NOFILE is {hard}: "
                 f"the largest N this machine holds is {largest_world()}")
    if need > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def largest_world() -> int:
    """Each side holds one descriptor per rank, and every connection takes one local port."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return min(hard - FD_MARGIN, high - low + 1)


# ---------------------------------------------------------------- the supervisor's side (its own process)


def serve(world: int, token: str, root: str, hello_timeout_s: float | None) -> None:
    """A real Monitor, mshpc imported from `root` (the driver puts it first on PYTHONPATH); prints
    its port, then {"registered": k, "t": monotonic} as k grows, until stdin closes.
    CLOCK_MONOTONIC is the machine's, so the driver can compare times."""
    from mshpc.launch.monitor import Monitor

    assert Path(sys.modules[Monitor.__module__].__file__ or "").is_relative_to(root), "mshpc not from ROOT"

    raise_nofile(world + FD_MARGIN)
    monitor = Monitor(world, token) if hello_timeout_s is None else Monitor(world, token, hello_timeout_s=hello_timeout_s)
    print(json.dumps({"port": monitor.port, "module": sys.modules[Monitor.__module__].__file__}), flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    seen, said_at = 0, 0.0
    while not done.wait(0.02):
        states = list(monitor.ranks.values())
        count = sum(s.host is not None for s in states)
        if count != seen or time.monotonic() - said_at > 1.0:
            seen, said_at = count, time.monotonic()
            # the sum of steps counts the beats that arrived: each simulated beat is the next step
            print(json.dumps({"registered": count, "t": said_at, "beats": sum(s.step + 1 for s in states)}),
                  flush=True)
    monitor.close()


class Supervisor:
    """The serving process, seen from the driver: its port, its registrations, its /proc."""

    def __init__(self, world: int, token: str, root: Path, hello_timeout_s: float | None) -> None:
        extra = [] if hello_timeout_s is None else ["--hello-timeout-s", str(hello_timeout_s)]
        # the checkout under `root` first on the path: its mshpc, not the installed one (a baseline revision)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(world), token, str(root), *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first:
            sys.exit(f"sim_peers: the monitor process for N={world} ended before it listened")
        self.port, self.module = json.loads(first)["port"], json.loads(first)["module"]
        self.registered, self.last_t, self.beats = 0, 0.0, 0
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            update = json.loads(line)
            self.beats = update["beats"]
            if update["registered"] != self.registered:
                self.registered, self.last_t = update["registered"], update["t"]

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)

    def status(self, key: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- the driver


def emit(metric: str, value: float, unit: str, n: int | None = None, **extra: Any) -> None:
    # imported here, not at the top: the serving process may run a baseline revision's mshpc,
    # which has no mshpc.bench
    from mshpc.bench import harness

    harness.emit({"bench": "scale_monitor", "metric": metric, "value": value, "unit": unit,
                  **({"n": n} if n is not None else {}), **extra})


async def measure(world: int, root: Path, measure_s: float = MEASURE_S,
                  hello_timeout_s: float | None = None) -> dict[str, Any]:
    """One N against the mshpc under `root`: registration time, then CPU per wall second and RSS
    over `measure_s` of beats."""
    token = uuid.uuid4().hex
    supervisor = Supervisor(world, token, root, hello_timeout_s)
    stop = asyncio.Event()
    start = time.monotonic()
    peers = asyncio.ensure_future(run_world("127.0.0.1", supervisor.port, token, world, stop))
    while supervisor.registered < world and time.monotonic() - start < REGISTER_WAIT_S and not peers.done():
        await asyncio.sleep(0.05)
    registered = supervisor.registered
    register_s = supervisor.last_t - start if registered == world else None  # not all within the wait
    cpu0, wall0, beats0 = supervisor.cpu_s(), time.monotonic(), supervisor.beats
    await asyncio.sleep(measure_s)
    wall_s = time.monotonic() - wall0
    figures = {"register_s": register_s, "registered": registered,
               "cpu_per_s": (supervisor.cpu_s() - cpu0) / wall_s,
               "beats_per_s": (supervisor.beats - beats0) / wall_s,  # below N: the peers cannot keep 1 Hz
               "rss_mib": supervisor.status("VmRSS") / 1024, "threads": supervisor.status("Threads")}
    stop.set()
    figures["connected"] = await peers
    supervisor.stop()
    return figures


def report(world: int, ours: dict[str, Any], base: dict[str, Any] | None, label: str) -> None:
    """One line per figure, the baseline's beside ours (ratio: ours / the baseline's)."""
    for key, metric, unit in (("register_s", "time_to_register_all", "s"), ("cpu_per_s", "supervisor_cpu_per_wall_s",
                              "core"), ("rss_mib", "supervisor_rss", "MiB"), ("threads", "supervisor_threads", "1"),
                              ("beats_per_s", "beats_received_per_s", "1/s")):
        extra: dict[str, Any] = {}
        if key == "register_s":
            extra = {"registered": ours["registered"], "connected": ours["connected"], "waited_s": REGISTER_WAIT_S}
        if base is not None:
            extra.update(baseline=_round(base[key]), baseline_monitor=label)
            if key == "register_s":
                extra.update(baseline_registered=base["registered"])
            if ours[key] is not None and base[key]:
                extra["ratio"] = round(ours[key] / base[key], 3)
        emit(metric + ("_vs_" + label if base is not None else ""), _round(ours[key]), unit, world, **extra)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def checkout(rev: str) -> Path:
    """mshpc as it was at `rev`, exported to a temporary folder (the baseline's monitor)."""
    repo = Path(__file__).resolve().parents[2]
    dest = Path(tempfile.mkdtemp(prefix="sim_peers_baseline_"))
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "mshpc"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x: the growth exponent (1.0 = linear)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[512, 2048, 4096, 12288])
    parser.add_argument("--measure-s", type=float, default=MEASURE_S, help="seconds of beats measured")
    parser.add_argument("--baseline", metavar="REV", help="also measure the Monitor of this git revision "
                        "(2750752: the thread-per-connection one), side by side")
    parser.add_argument("--hello-timeout-s", type=float, help="the Monitor's (default: its HELLO_TIMEOUT_S); "
                        "longer when this one process of peers cannot say hello that soon after the accept")
    parser.add_argument("--serve", nargs=3, metavar=("WORLD", "TOKEN", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1], args.serve[2], args.hello_timeout_s)
        return
    if max(args.n) > largest_world():
        sys.exit(f"sim_peers: N={max(args.n)} is past this machine: the largest N it holds is {largest_world()} "
                 "(RLIMIT_NOFILE hard limit and local port range)")
    raise_nofile(max(args.n) + FD_MARGIN)
    ours_root = Path(__file__).resolve().parents[2]
    base_root = checkout(args.baseline) if args.baseline else None
    cpu: dict[str, list[float]] = {"ours": [], "baseline": []}
    for n in args.n:
        base = asyncio.run(measure(n, base_root, args.measure_s, args.hello_timeout_s)) if base_root else None
        ours = asyncio.run(measure(n, ours_root, args.measure_s, args.hello_timeout_s))
        report(n, ours, base, f"threads_at_{args.baseline}")
        cpu["ours"].append(ours["cpu_per_s"])
        if base is not None:
            cpu["baseline"].append(base["cpu_per_s"])
    if len(args.n) > 1:
        extra = {"baseline": round(slope(args.n, cpu["baseline"]), 3)} if base_root else {}
        emit("supervisor_cpu_growth_exponent", round(slope(args.n, cpu["ours"]), 3), "1", ns=args.n, **extra)


if __name__ == "__main__":
    main()
