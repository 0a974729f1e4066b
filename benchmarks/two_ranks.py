"""Two ranks of a benchmark on a rate-limited link, and side-by-side step timing (shared by
dp_overlap.py and tp_overlap.py).

The two ranks run in two network namespaces joined by a veth pair, with a `tc` token-bucket rate
limit on each end (addresses on that private link only: nothing leaves the machine); then once
more with the limit removed. Without root or iproute2 they run on loopback, and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ADDRS = ("10.77.0.1", "10.77.0.2")  # the private veth link between the two namespaces
PORT = 29500  # free by construction: the namespaces are new
WORKER_TIMEOUT_S = 600


class Link:
    """Two namespaces joined by a veth pair; `set_rate` puts a tbf limit on both ends. `kind`
    (two letters: the benchmark's) keeps the names apart from other benchmarks' running beside."""

    def __init__(self, kind: str) -> None:
        tag = os.getpid() % 100000
        self.ns = (f"mshpc-{kind}{tag}a", f"mshpc-{kind}{tag}b")
        self.dev = (f"m{kind}{tag}a", f"m{kind}{tag}b")  # interface names: 15 characters at most

    def __enter__(self) -> Link:
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, ADDRS):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for ns in self.ns:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def set_rate(self, rate_mbit: float | None, queue_ms: float = 10.0) -> None:
        for ns, dev in zip(self.ns, self.dev):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)  # absent the first time
            if rate_mbit is not None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", f"{queue_ms}ms"],
                               check=True, capture_output=True)

    def prefix(self, rank: int) -> tuple[list[str], dict[str, str]]:
        # gloo must use the veth: the host name resolves to an address the namespace cannot reach
        return ["ip", "netns", "exec", self.ns[rank]], {"GLOO_SOCKET_IFNAME": self.dev[rank]}


class Loopback:
    """The fallback: both ranks on 127.0.0.1, no rate limit possible."""

    def prefix(self, rank: int) -> tuple[list[str], dict[str, str]]:
        return [], {"GLOO_SOCKET_IFNAME": "lo"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not installed (apt-get install -y iproute2)" if missing else None


def run_pair(script: str, link: Link | Loopback, addr: str, port: int, args: argparse.Namespace) -> dict:
    """Start `script --worker RANK --addr --port` plus every other option in `args` as rank 0 and
    rank 1, wait for both, return the JSON object rank 0 printed last."""
    procs = []
    for rank in range(2):
        prefix, env = link.prefix(rank)
        cmd = [*prefix, sys.executable, script, "--worker", str(rank), "--addr", addr, "--port", str(port),
               *_options(args)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, **env, "PYTHONPATH": str(REPO)}))
    try:
        outs = [p.communicate(timeout=WORKER_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"{Path(script).stem}: rank {rank} failed (exit {p.returncode}):\n{err[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """The options run_pair gives each rank, hidden from --help."""
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)


def _options(args: argparse.Namespace) -> list[str]:
    out = []
    for key, value in vars(args).items():
        if key not in ("worker", "addr", "port"):
            values = value if isinstance(value, list) else [value]
            out += [f"--{key.replace('_', '-')}", *map(str, values)]
    return out


def run_on_links(script: str, kind: str, rate_mbit: float, args: argparse.Namespace) -> dict[str, dict]:
    """rank 0's results by link: the rate-limited veth, then the same link unlimited; or, where
    namespaces cannot be made, loopback (and a line on stderr saying why)."""
    reason = why_no_namespaces()
    if reason is None:
        results = {}
        with Link(kind) as link:
            for label, rate in ((f"{rate_mbit:g}mbit", rate_mbit), ("unlimited", None)):
                link.set_rate(rate)
                results[label] = run_pair(script, link, ADDRS[0], PORT, args)
        return results
    print(f"{Path(script).stem}: cannot create network namespaces ({reason}); running on loopback, "
          "without a rate limit", file=sys.stderr)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"loopback": run_pair(script, Loopback(), "127.0.0.1", port, args)}


def time_steps(steps: dict, rounds: int, per_round: int) -> dict[str, float]:
    """Steady-state step time: median over rounds of the mean of `per_round` consecutive steps.
    An untimed lead-in step comes first, so the first timed forward waits for the all-gathers
    of a previous step, as every forward in training does; the last timed step's all-gathers
    are the next step's to wait for, and land after the clock stops. The contenders take turns
    within each round, so a noisy neighbour on the machine slows all of them alike. Round 0 is
    warm-up."""
    from mshpc.parallel import comm

    names = [n for n in steps if n != "facts"]
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for name in names:
            step, finish = steps[name]
            comm.barrier()  # not between lead-in and clock: it would wait for the all-gathers
            step()
            start = time.perf_counter()
            for _ in range(per_round):
                step()
            elapsed = time.perf_counter() - start
            finish()
            if r > 0:
                samples[name].append(elapsed / per_round)
    return {n: statistics.median(s) for n, s in samples.items()}
