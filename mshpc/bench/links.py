"""Two ranks of a benchmark on an emulated link (dp_overlap, tp_overlap, pipeline): two nodes of a
namespace fabric (`netns`) with a `tc` token-bucket rate limit on each node's link (addresses on
that private bridge only: nothing leaves the machine), then once more with the limit removed.
Without root or iproute2 they run on loopback, and say so."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mshpc.bench.harness import WORKER_TIMEOUT_S, emit, time_rounds
from mshpc.bench.netns import Fabric, run_ranks, why_unavailable

PORT = 29500  # free by construction: the namespaces are new
Steps = dict[str, tuple[Callable[[], None], Callable[[], None]]]


class Loopback:
    """The fallback: both ranks on 127.0.0.1, no rate limit possible."""

    def prefix(self, i: int, hostname: str | None = None) -> tuple[list[str], dict[str, str]]:
        return [], {"GLOO_SOCKET_IFNAME": "lo"}


def run_pair(script: str, link: Fabric | Loopback, addr: str, port: int, args: argparse.Namespace) -> Any:
    """Start `script --worker RANK --addr --port` plus every other option in `args` as rank 0 and
    rank 1, wait for both, return the JSON object rank 0 printed last."""
    commands = []
    for rank in range(2):
        prefix, env = link.prefix(rank)
        cmd = [*prefix, sys.executable, script, "--worker", str(rank), "--addr", addr, "--port", str(port),
               *_options(args)]
        commands.append((cmd, env))
    try:
        done = run_ranks(commands, WORKER_TIMEOUT_S)
    except RuntimeError as exc:
        raise SystemExit(f"{Path(script).stem}: {exc}") from None
    return json.loads(done[0].stdout.strip().splitlines()[-1])


def add_link_options(parser: argparse.ArgumentParser) -> None:
    """--rate-mbit, and the options run_pair gives each rank (hidden from --help)."""
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="the limited link's rate")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)


def _options(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for key, value in vars(args).items():
        if key not in ("worker", "addr", "port"):
            values = value if isinstance(value, list) else [value]
            out += [f"--{key.replace('_', '-')}", *map(str, values)]
    return out


def main_on_links(script: str, kind: str, args: argparse.Namespace,
                  worker: Callable[[argparse.Namespace], None],
                  lines: Callable[[str, Any, argparse.Namespace], list[dict[str, Any]]]) -> dict[str, Any] | None:
    """A benchmark's main: the worker, when run_pair started this process as a rank; otherwise both
    ranks on every link, printing each link's JSON lines. Returns rank 0's results by link."""
    if args.worker is not None:
        worker(args)
        return None
    results = run_on_links(script, kind, args.rate_mbit, args)
    for label, r in results.items():
        for record in lines(label, r, args):
            emit(record)
    return results


def run_on_links(script: str, kind: str, rate_mbit: float, args: argparse.Namespace) -> dict[str, Any]:
    """rank 0's results by link: the rate-limited veth, then the same link unlimited; or, where
    namespaces cannot be made, loopback (and a line on stderr saying why)."""
    reason = why_unavailable()
    if reason is None:
        results: dict[str, Any] = {}
        with Fabric(kind, 2) as link:
            for label, rate in ((f"{rate_mbit:g}mbit", rate_mbit), ("unlimited", None)):
                for rank in range(2):
                    link.set_rate(rank, rate)
                results[label] = run_pair(script, link, link.addr(0), PORT, args)
        return results
    print(f"{Path(script).stem}: cannot create network namespaces ({reason}); running on loopback, "
          "without a rate limit", file=sys.stderr)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"loopback": run_pair(script, Loopback(), "127.0.0.1", port, args)}


def time_steps(steps: Steps, rounds: int, per_round: int) -> dict[str, float]:
    """Steady-state step time: the median over rounds of `harness.time_rounds`."""
    return {n: statistics.median(s) for n, s in time_rounds(steps, rounds, per_round).items()}


def measure_link_mbit(rank: int, addr: str, port: int, nbytes: int = 32 << 20) -> float | None:
    """Rank 1 sends `nbytes` to rank 0 over a plain TCP socket, nothing else on the link; rank 0
    returns the rate it received them at, first byte to last (rank 1 returns None). What the
    link really carries, to check a `tc` limit took hold (and how far an unlimited one goes)."""
    if rank == 1:
        payload = bytes(1 << 20)
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = socket.create_connection((addr, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # rank 0 is not listening yet
        with conn:
            for _ in range(nbytes // len(payload)):
                conn.sendall(payload)
            conn.recv(1)  # rank 0's word that all arrived, so the socket closes after it
        return None
    with socket.create_server((addr, port)) as server:
        conn, _ = server.accept()
        with conn:
            first = got = len(conn.recv(1 << 20))  # the clock starts once the first bytes are in
            start = time.perf_counter()
            while got < nbytes:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    raise SystemExit(f"link check: the sender stopped after {got} of {nbytes} bytes")
                got += len(chunk)
            elapsed = time.perf_counter() - start
            conn.sendall(b"k")
    return (nbytes - first) * 8 / elapsed / 1e6 if elapsed > 0 else None
