"""Nodes emulated on this machine, for tests and benchmarks: network namespaces, each with one
veth link into a bridge (in a hub namespace of its own), and optionally a `tc` rate limit on
one node's link, both ways. Addresses are on that private bridge only: nothing leaves the
machine. Needs root and iproute2; `why_unavailable` says why not where it cannot be set up."""

from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.77.0"  # inside the fabric's own namespaces: no clash with the host or other fabrics


def why_unavailable() -> str | None:
    """None where namespaces can be made here, else the reason."""
    if os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not installed (apt-get install -y iproute2 util-linux)" if missing else None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Fabric:
    """`n` namespaces joined by a bridge; `tag` (a few letters unique to the caller) names them,
    with this process's id, so that fabrics of concurrent tests never collide."""

    def __init__(self, tag: str, n: int) -> None:
        name = f"{tag}{os.getpid() % 100000}"  # + 'h9' and such: 15 characters at most, as Linux wants
        self.ns = [f"mshpc-{name}-{i}" for i in range(n)]
        self.hub = f"mshpc-{name}-hub"
        self.dev = [f"{name}n{i}" for i in range(n)]  # a node's end of its link, in its namespace
        self.hub_dev = [f"{name}h{i}" for i in range(n)]  # the bridge's end
        self.bridge = f"{name}br"

    def __enter__(self) -> Fabric:
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", self.bridge, "type", "bridge")
            _ip("-n", self.hub, "link", "set", self.bridge, "up")
            for i, (ns, dev, hub_dev) in enumerate(zip(self.ns, self.dev, self.hub_dev, strict=True)):
                _ip("netns", "add", ns)
                _ip("link", "add", dev, "type", "veth", "peer", "name", hub_dev)
                _ip("link", "set", dev, "netns", ns)
                _ip("link", "set", hub_dev, "netns", self.hub)
                _ip("-n", self.hub, "link", "set", hub_dev, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for ns in [*self.ns, self.hub]:  # deleting a namespace deletes its veth ends, and so the pairs
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def set_rate(self, i: int, rate_mbit: float | None, queue_ms: float = 10.0) -> None:
        """A token-bucket limit on node i's link, both ways (None removes it)."""
        for ns, dev in ((self.ns[i], self.dev[i]), (self.hub, self.hub_dev[i])):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)  # absent the first time
            if rate_mbit is not None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", f"{queue_ms}ms"],
                               check=True, capture_output=True)

    def prefix(self, i: int, hostname: str | None = None) -> tuple[list[str], dict[str, str]]:
        """Command prefix and environment that run a command on node i; with `hostname`, in a
        UTS namespace of its own too, so that the node has that name."""
        cmd = ["ip", "netns", "exec", self.ns[i]]
        if hostname is not None:
            cmd += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
        # gloo must use the veth: the host name resolves to an address the namespace cannot reach
        return cmd, {"GLOO_SOCKET_IFNAME": self.dev[i]}


def run_ranks(commands: list[tuple[list[str], dict[str, str]]], timeout_s: float,
              ok_codes: tuple[int, ...] = (0,)) -> list[subprocess.CompletedProcess[str]]:
    """Start one process per (argv, environment) at once, as the ranks of one job (in a fabric's
    namespaces, or here), and wait for all; on a timeout or an exit outside `ok_codes`, every
    rank still running is killed and RuntimeError names the rank, with its last output."""
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **env}) for argv, env in commands]
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    done = [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
    for rank, result in enumerate(done):
        if result.returncode not in ok_codes:
            raise RuntimeError(f"rank {rank} exited with code {result.returncode}:\n{result.stderr[-3000:]}")
    return done
