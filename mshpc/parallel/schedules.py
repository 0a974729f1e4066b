"""Pipeline schedules as plain data: the forwards, backwards, sends, receives and send-waits each
pipeline rank runs in one step, in order. Pure arithmetic: every rank derives its own plan, the
tests check every plan for deadlock and memory, and `pipeline.py` only executes it.

Stages are virtual (Narayanan et al. 2021, sec. 2.2): with pp ranks and v chunks per rank, the
model is cut into pp * v stages and stage g runs on pp rank g % pp as its chunk g // pp. Three
orders of compute: GPipe (all forwards, then all backwards), 1F1B (PipeDream-Flush: warm up
with pp - rank - 1 forwards, then alternate), and interleaved 1F1B (Megatron-LM's order over
virtual stages).

Communication is lowered onto four links, each a channel that carries one kind of tensor in one
direction between neighbours: `act` (stage g -> g + 1, pp rank r -> r + 1), `grad` (g -> g - 1,
r -> r - 1), and their `_wrap` twins for the hops from the last pp rank back to the first (and
the reverse) that only interleaving has. On each link the receiver consumes in the order the
sender sends, so messages match in FIFO order, which is all NCCL offers. Receives are posted
early: the first of each link at the start of the step, each next one just before the compute
that consumes the previous one, so its transfer overlaps that compute and at most two buffers
are in flight per link (MegaScale, Jiang et al. 2024, sec. 3.2: decoupled send/recv). Sends are never
waited on to proceed: an activation's send is waited after its backward, when the output is
freed; a gradient's before the next gradient send on its link, and the rest at the step's end.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["1f1b", "gpipe"]
Op = Literal["forward", "backward", "recv_act", "recv_grad", "send_act", "send_grad",
             "wait_send_act", "wait_send_grad"]
LINKS = ("act", "act_wrap", "grad", "grad_wrap")


@dataclass(frozen=True)
class Action:
    """One thing a pipeline rank does. For compute, `stage` is the virtual stage it runs; for
    communication, the stage on this rank whose input (recv) or output (send) moves."""

    op: Op
    micro: int
    stage: int


@dataclass(frozen=True)
class PipeShape:
    pp: int
    virtual_stages: int
    micro_batches: int

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages


# ---------------------------------------------------------------- compute order


def _interleaved_index(k: int, shape: PipeShape, forward: bool) -> tuple[int, int]:
    """Megatron-LM's interleaved order: the k-th forward (backward) of a rank is micro-batch
    `micro` on chunk `chunk`; micro-batches go through the chunks in groups of pp."""
    p, v = shape.pp, shape.virtual_stages
    group, within = divmod(k, p * v)
    chunk = within // p
    return group * p + within % p, chunk if forward else v - 1 - chunk


def compute_order(name: ScheduleName, shape: PipeShape, rank: int) -> list[Action]:
    """The forwards and backwards of pp rank `rank` in one step, in order. Interleaving needs
    micro_batches divisible by pp (config.py says so to users)."""
    assert shape.virtual_stages == 1 or (shape.pp > 1 and shape.micro_batches % shape.pp == 0), shape
    p, v, m = shape.pp, shape.virtual_stages, shape.micro_batches
    total = m * v

    def action(op: Op, k: int) -> Action:
        micro, chunk = _interleaved_index(k, shape, op == "forward")
        return Action(op, micro, chunk * p + rank)

    if name == "gpipe":
        warmup = total
    elif v == 1:
        warmup = min(p - rank - 1, m)  # 1F1B: fill the pipe below this stage, then alternate
    else:  # Narayanan et al. 2021 sec. 2.2; Megatron-LM's forward_backward_pipelining_with_interleaving
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [action("forward", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action("forward", warmup + i), action("backward", i)]
    return order + [action("backward", k) for k in range(total - warmup, total)]


# ---------------------------------------------------------------- communication


def link(a: Action, pp: int) -> tuple[str, int]:
    """The link a communication action travels and the pp rank at its other end."""
    rank = a.stage % pp
    if a.op in ("recv_act", "send_act", "wait_send_act"):
        to_next = a.op != "recv_act"
        peer = (rank + 1) % pp if to_next else (rank - 1) % pp
        wrap = rank == (pp - 1 if to_next else 0)
        return ("act_wrap" if wrap else "act"), peer
    to_prev = a.op in ("send_grad", "wait_send_grad")
    peer = (rank - 1) % pp if to_prev else (rank + 1) % pp
    wrap = rank == (0 if to_prev else pp - 1)
    return ("grad_wrap" if wrap else "grad"), peer


def _recv_for(a: Action, stages: int) -> Action | None:
    if a.op == "forward" and a.stage > 0:
        return Action("recv_act", a.micro, a.stage)
    if a.op == "backward" and a.stage < stages - 1:
        return Action("recv_grad", a.micro, a.stage)
    return None


def _send_for(a: Action, stages: int) -> Action | None:
    if a.op == "forward" and a.stage < stages - 1:
        return Action("send_act", a.micro, a.stage)
    if a.op == "backward" and a.stage > 0:
        return Action("send_grad", a.micro, a.stage)
    return None


def lower(order: list[Action], shape: PipeShape) -> list[Action]:
    """Insert the receives, sends and send-waits into one rank's compute order (see the module
    docstring for where each goes). A compute action implies waiting for its own receive."""
    recvs: dict[str, deque[Action]] = defaultdict(deque)
    for a in order:
        r = _recv_for(a, shape.stages)
        if r is not None:
            recvs[link(r, shape.pp)[0]].append(r)
    plan = [q.popleft() for _, q in sorted(recvs.items())]  # the first of every link: now
    last_grad_send: dict[str, Action] = {}
    for a in order:
        r = _recv_for(a, shape.stages)
        if r is not None and recvs[link(r, shape.pp)[0]]:
            plan.append(recvs[link(r, shape.pp)[0]].popleft())  # the next on that link
        plan.append(a)
        if a.op == "backward" and a.stage < shape.stages - 1:
            plan.append(Action("wait_send_act", a.micro, a.stage))  # its output is freed now
        s = _send_for(a, shape.stages)
        if s is not None and s.op == "send_grad":
            name = link(s, shape.pp)[0]
            if name in last_grad_send:
                previous = last_grad_send[name]
                plan.append(Action("wait_send_grad", previous.micro, previous.stage))
            last_grad_send[name] = s
        if s is not None:
            plan.append(s)
    return plan + [Action("wait_send_grad", s.micro, s.stage) for _, s in sorted(last_grad_send.items())]


def build_plan(name: ScheduleName, shape: PipeShape, rank: int) -> list[Action]:
    """Everything pp rank `rank` does in one step of schedule `name` (with virtual_stages > 1,
    "1f1b" is interleaved 1F1B)."""
    return lower(compute_order(name, shape, rank), shape)


# ---------------------------------------------------------------- what a schedule promises


def bubble_fraction(shape: PipeShape) -> float:
    """The idle fraction of a step with equal stages and free communication: (p - 1) / (m + p - 1)
    for GPipe and 1F1B, (p - 1) / (v * m + p - 1) for interleaved 1F1B (Narayanan et al. 2021,
    sec. 2.2: bubble (p - 1) / (v * m) of the ideal time)."""
    p, v, m = shape.pp, shape.virtual_stages, shape.micro_batches
    return (p - 1) / (v * m + p - 1)


def peak_live(plan: list[Action]) -> int:
    """The most (micro-batch, stage) activations held at once: forwards run whose backward has
    not (a chunk's activation counts 1; it is 1/v of a whole stage's)."""
    live = peak = 0
    for a in plan:
        live += (a.op == "forward") - (a.op == "backward")
        peak = max(peak, live)
    return peak
