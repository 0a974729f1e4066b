"""Run every rank's pipeline plan against the others on a virtual clock: the strictest reading of
the communication the runtime issues, to find deadlocks, mismatched messages and the bubble.

Semantics: each link (name, sender, receiver) is a FIFO, so the k-th send on it meets the k-th
receive; a message is there once its send is posted (communication costs nothing); a send-wait
returns only once the receiver has posted the matching receive (a rendezvous, as NCCL and large
gloo messages behave); posting costs nothing; forward and backward take fixed times.
"""

from __future__ import annotations

from dataclasses import dataclass

from mshpc.parallel.schedules import Action, PipeShape, link


class Deadlock(AssertionError):
    pass


@dataclass(frozen=True)
class Timeline:
    step: float  # when the last rank finished
    busy: list[float]  # compute time per rank

    @property
    def bubble(self) -> float:
        """Mean idle fraction of the ranks."""
        return 1 - sum(self.busy) / (len(self.busy) * self.step)


def _key(a: Action, rank: int, pp: int) -> tuple[str, int, int]:
    name, peer = link(a, pp)
    return (name, peer, rank) if a.op.startswith("recv") else (name, rank, peer)


def _expected_send(recv: Action) -> Action:
    if recv.op == "recv_act":
        return Action("send_act", recv.micro, recv.stage - 1)
    return Action("send_grad", recv.micro, recv.stage + 1)


def simulate(plans: list[list[Action]], shape: PipeShape, forward: float = 1.0, backward: float = 2.0) -> Timeline:
    """Execute the plans; raise Deadlock when no rank can go on, AssertionError on a message
    that meets the wrong receive. A chunk's compute takes 1/v of a whole stage's."""
    p, v = shape.pp, shape.virtual_stages
    posted: dict[tuple, list[tuple[Action, float]]] = {}  # link key -> posts in order (sends, recvs)
    where: dict[tuple[int, Action], tuple[tuple, int]] = {}  # (rank, action) -> (key, index)
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p

    def post(rank: int, a: Action) -> None:
        key = (*_key(a, rank, p), a.op.split("_")[0])
        where[rank, a] = key, len(posted.setdefault(key, []))
        posted[key].append((a, clock[rank]))

    def partner(rank: int, a: Action, side: str) -> tuple[Action, float] | None:
        assert (rank, a) in where, f"rank {rank} waits for {a}, which it never posted"
        key, index = where[rank, a]
        other = posted.get((*key[:3], side), [])
        return other[index] if index < len(other) else None

    def try_run(rank: int, a: Action) -> bool:
        if a.op.startswith(("recv", "send")):
            post(rank, a)
            return True
        if a.op.startswith("wait"):
            send = Action(a.op.removeprefix("wait_"), a.micro, a.stage)
            match = partner(rank, send, "recv")
            if match is None:
                return False
            clock[rank] = max(clock[rank], match[1])
            return True
        recv = {"forward": Action("recv_act", a.micro, a.stage),
                "backward": Action("recv_grad", a.micro, a.stage)}[a.op]
        if (rank, recv) in where:
            match = partner(rank, recv, "send")
            if match is None:
                return False
            assert match[0] == _expected_send(recv), f"rank {rank}: {recv} met {match[0]}"
            clock[rank] = max(clock[rank], match[1])
        cost = (forward if a.op == "forward" else backward) / v
        clock[rank] += cost
        busy[rank] += cost
        return True

    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while pos[rank] < len(plans[rank]) and try_run(rank, plans[rank][pos[rank]]):
                pos[rank] += 1
                progress = True
    stuck = {r: plans[r][pos[r]] for r in range(p) if pos[r] < len(plans[r])}
    if stuck:
        raise Deadlock(f"{shape}: stuck at {stuck}")
    return Timeline(step=max(clock), busy=busy)
