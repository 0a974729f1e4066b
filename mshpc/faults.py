"""Fault injection for tests: MSHPC_TEST_FAULTS (read by launch/env.py), bound to one rank as
InjectedFaults, the FaultHooks that the train loop, preflight and the saver call. Only
mshpc/fault_setup.py builds it; product code sees the FaultHooks interface alone.

Spec: `;`-separated faults, each `KIND:rank=R:step=S` or `KIND:node=NAME:step=S` (fires on
whichever rank runs on that node, or local slot), optionally `:attempt=A` (only in the
supervisor's attempt A; without it, in every attempt). KIND one of
  raise  raise RuntimeError in the step (a Python crash with a traceback)
  kill   SIGKILL this rank (a crash with no chance to clean up)
  kill_in_save  SIGKILL this rank in stage 2 of the save of step S, after every shard is
                written and before rank 0 commits (so on rank 0 the save is never committed)
  enospc_in_save  this rank's shard write of the save of step S fails with ENOSPC (errno 28), as a
                full file system makes it: the save fails on every rank alike
  slow_save  sleep F seconds at that same point (a slow file system): `slow_save:rank=R:step=S:factor=F`
  stop   SIGSTOP this rank (a hang: the process is frozen, its heartbeat falls silent)
  raise_in_collective  the rank's next collective raises RuntimeError inside comm's door (recorded first)
  nan    this rank's next forward pass returns NaN (the loss, then the weights, go NaN)
  corrupt_latest  flip a byte of a master tensor in the latest committed checkpoint
  slow   from step S on, each forward on rank R takes `factor` times as long, a sleep after it
         (a slower device): `slow:rank=R:step=S:factor=F`, F >= 1
  grad_flip   in step S, one bit flips in a gradient this rank computes (its largest element's top
              exponent bit: it becomes huge or Inf), once: a transient silent data corruption
  grad_flips  the same in every step from S on, in its first run only (a replay of it is clean):
              a device that keeps corrupting data
  corrupt_snapshot  before this rank restores in place (`KIND:rank=R`, no step), one bit flips in
              each snapshot it keeps for the rank it is the buddy of
and, honoured by `mshpc preflight` (no step: `KIND:rank=R`),
  gemm_slow   this rank's GEMMs take SLOW_FACTOR times as long (the device tests and the burn)
  gemm_wrong  one element of each GEMM result on this rank is wrong (silent data corruption)
Steps are 0-based. A bound fault (see `bind`) records a `fault_injected` event before it fires.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mshpc.errors import ConfigError
from mshpc.events import append_event
from mshpc.fault_hooks import FaultHooks
from mshpc.parallel import comm

KINDS = ("raise", "kill", "kill_in_save", "enospc_in_save", "slow_save", "stop", "raise_in_collective", "nan", "corrupt_latest",
         "slow", "gemm_slow", "gemm_wrong", "grad_flip", "grad_flips", "corrupt_snapshot")
# every other kind fires in the step phase
_PHASE = {"kill_in_save": "save", "enospc_in_save": "write", "slow_save": "save", "slow": "forward", "gemm_slow": "preflight", "gemm_wrong": "preflight",
          "corrupt_snapshot": "restore"}  # the snapshot keeper's hook (before_restore) fires it
# what each kind takes besides its target (rank= or node=) and an optional attempt=
_FIELDS = {"slow": {"step", "factor"}, "slow_save": {"step", "factor"}, "gemm_slow": set(), "gemm_wrong": set(),
           "corrupt_snapshot": set()}
SLOW_FACTOR = 4  # gemm_slow: each GEMM runs this many times and counts once


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int  # -1 for a node-targeted fault until `bind` gives it the rank running there
    step: int = 0
    factor: float = 1.0  # slow: how many times as long each forward takes
    node: str | None = None
    attempt: int | None = None
    run_dir: Path | None = None  # set by `bind`: where the injection is recorded
    ckpt_root: Path | None = None  # set by `bind`: what corrupt_latest corrupts


def _parse_one(text: str) -> Fault:
    kind, *fields = text.strip().split(":")
    values = dict(f.split("=", 1) for f in fields if "=" in f)
    attempt = values.pop("attempt", None)
    extra = _FIELDS.get(kind, {"step"})
    if kind not in KINDS or set(values) not in ({"rank", *extra}, {"node", *extra}):
        raise ConfigError(f"MSHPC_TEST_FAULTS entry {text!r} must be KIND:rank=R:step=S or "
                          f"KIND:node=NAME:step=S [:attempt=A] (slow, slow_save: also :factor=F; gemm_*: no step), "
                          f"KIND in {', '.join(KINDS)}")
    try:
        fault = Fault(kind, int(values.get("rank", -1)), int(values.get("step", 0)),
                      float(values.get("factor", 1.0)), values.get("node"),
                      None if attempt is None else int(attempt))
    except ValueError:
        raise ConfigError(f"MSHPC_TEST_FAULTS entry {text!r}: rank, step and attempt must be integers, "
                          "factor a number") from None
    if fault.factor < 1:
        raise ConfigError(f"MSHPC_TEST_FAULTS entry {text!r}: factor must be >= 1")
    return fault


def parse_faults(spec: str | None) -> tuple[Fault, ...]:
    return tuple(_parse_one(part) for part in (spec or "").split(";") if part.strip())


def bind(faults: tuple[Fault, ...], rank: int, node: str, attempt: int, run_dir: Path | None,
         ckpt_root: Path | None) -> tuple[Fault, ...]:
    """The faults meant for this process (its rank or node, this attempt), ready to fire; with no
    run_dir (preflight) an injection is not recorded."""
    mine = []
    for f in faults:
        here = f.node == node if f.node is not None else f.rank == rank
        if here and f.attempt in (None, attempt):
            mine.append(replace(f, rank=rank, run_dir=run_dir, ckpt_root=ckpt_root))
    return tuple(mine)


def _due(fault: Fault, rank: int, step: int, phase: str) -> bool:
    if fault.rank != rank or _PHASE.get(fault.kind, "step") != phase:
        return False
    return step >= fault.step if fault.kind == "grad_flips" else step == fault.step


def inject(faults: tuple[Fault, ...], rank: int, step: int, phase: str = "step") -> None:
    """Fire the faults planned for this rank at this step (0-based) and phase, if any."""
    for fault in faults:
        if _due(fault, rank, step, phase):
            _record(fault, rank, step)
            _fire(fault, rank, step)


def _record(fault: Fault, rank: int, step: int) -> None:
    if fault.run_dir is not None:
        target = os.readlink(fault.ckpt_root / "latest") if fault.kind == "corrupt_latest" and fault.ckpt_root else None
        append_event(fault.run_dir, "fault_injected", fault=fault.kind, rank=rank, node=fault.node,
                     step=step, attempt=fault.attempt, pid=os.getpid(), target=target)


def _fire(fault: Fault, rank: int, step: int) -> None:
    message = f"injected fault at rank {rank} step {step}"
    if fault.kind in ("kill", "kill_in_save"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "slow_save":
        time.sleep(fault.factor)
    elif fault.kind == "enospc_in_save":
        raise OSError(errno.ENOSPC, f"No space left on device ({message})")
    elif fault.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind == "raise_in_collective":
        fail_next_collective(f"{message} (inside a collective)")
    elif fault.kind == "nan":
        _poison_next_forward()
    elif fault.kind in ("grad_flip", "grad_flips"):
        _FLIP_NEXT_GRADIENT[0] = True
    elif fault.kind == "corrupt_latest":
        assert fault.ckpt_root is not None, "corrupt_latest needs a bound fault"
        _corrupt_latest(fault.ckpt_root)
    else:
        raise RuntimeError(message)


def fail_next_collective(message: str) -> None:
    """The next op through comm's one door (`comm.collective`), from any thread, raises
    RuntimeError(message) where it would have been issued, after the flight recorder saw it; then
    the door is comm's own again. Of two threads entering at once, one raises."""
    door, lock, armed = comm.collective, threading.Lock(), [True]

    def failing(group: Any, op: str, nbytes: int, issue: Callable[[], Any], peer: str = "") -> Any:
        with lock:
            fire, armed[0] = armed[0], False
            comm.collective = door  # one-shot: the door is comm's again
        if not fire:
            return door(group, op, nbytes, issue, peer)

        def fail() -> None:
            raise RuntimeError(message)
        return door(group, op, nbytes, fail, peer)

    comm.collective = failing  # comm's own ops look the door up by name


def _poison_next_forward() -> None:
    """The first floating-point module output of the next forward becomes NaN (as a silent
    data corruption on this rank would make it), through torch's global forward hook."""
    import torch

    def hook(module: torch.nn.Module, args: object, output: object) -> object:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            handle.remove()
            return output * float("nan")
        return None

    # torch types a global forward hook as returning None, yet honours a returned replacement output
    handle = torch.nn.modules.module.register_module_forward_hook(hook)  # type: ignore[arg-type]  # stub says -> None


# armed by a grad_flip fault in the step phase, spent by the first gradient of that step's backward
_FLIP_NEXT_GRADIENT = [False]


def _flip_hook(grad: torch.Tensor) -> torch.Tensor | None:
    """The top exponent bit of the largest element of the gradient flips, once armed: the value
    turns huge or Inf, as a corrupted multiply would make it."""
    if not _FLIP_NEXT_GRADIENT[0]:
        return None
    _FLIP_NEXT_GRADIENT[0] = False
    flipped = grad.detach().clone().float()
    bits = flipped.view(-1).view(torch.int32)
    bits[int(flipped.abs().argmax())] ^= 1 << 30
    return flipped.to(grad.dtype)


def flip_snapshots(buffers: list[torch.Tensor]) -> None:
    """One bit in the middle of each kept snapshot flips (past its header: its checksum must find it)."""
    for buffer in buffers:
        buffer[buffer.numel() // 2] ^= 0x04


def _corrupt_latest(root: Path) -> None:
    """Flip one byte of the largest master tensor of shard 0 of the latest checkpoint."""
    import h5py

    shard = root / "latest" / "shard-00000.h5"
    with h5py.File(shard, "r") as f:
        name = max(f["master"], key=lambda n: f["master"][n].size)
        offset = f["master"][name].id.get_offset()
    with open(shard, "r+b") as f:
        f.seek(offset + 16)
        byte = f.read(1)
        f.seek(offset + 16)
        f.write(bytes([byte[0] ^ 0x01]))


class InjectedFaults(FaultHooks):
    """The faults bound to this rank (see `bind`), fired at the product's hook points."""

    def __init__(self, faults: tuple[Fault, ...], rank: int) -> None:
        self.faults = faults
        self.rank = rank

    @property
    def gemm_slow_factor(self) -> int:
        return SLOW_FACTOR if planned(self.faults, "gemm_slow", self.rank) else 1

    @property
    def gemm_wrong(self) -> bool:
        return planned(self.faults, "gemm_wrong", self.rank)

    def at_step(self, step: int) -> None:
        inject(self.faults, self.rank, step)

    def before_write(self, step: int) -> None:
        inject(self.faults, self.rank, step, "write")

    def before_commit(self, step: int) -> None:
        inject(self.faults, self.rank, step, "save")

    def install_slowdown(self, model: nn.Module, start_step: int, forwards_per_step: int) -> None:
        install_slowdown(model, self.faults, self.rank, start_step, forwards_per_step)
        if any(f.kind in ("grad_flip", "grad_flips") for f in self.faults):
            next(p for p in model.parameters() if p.requires_grad).register_hook(_flip_hook)

    def before_restore(self, kept: list[torch.Tensor]) -> None:
        for fault in self.faults:
            if fault.kind == "corrupt_snapshot" and fault.rank == self.rank:
                _record(fault, self.rank, 0)
                flip_snapshots(kept)


def planned(faults: tuple[Fault, ...], kind: str, rank: int) -> bool:
    """Whether fault `kind` is planned for this rank (for faults with no step)."""
    return any(f.kind == kind and f.rank == rank for f in faults)


def install_slowdown(model: nn.Module, faults: tuple[Fault, ...], rank: int, start_step: int,
                     forwards_per_step: int) -> None:
    """Make this rank's forwards slow from each `slow` fault's step on; steps are counted from
    `start_step` in forwards of `model` (`forwards_per_step` per optimizer step)."""
    for fault in faults:
        if fault.kind == "slow" and fault.rank == rank:
            _slow_hooks(model, fault, itertools.count(start_step * forwards_per_step), forwards_per_step)


def _slow_hooks(model: nn.Module, fault: Fault, forwards: itertools.count, forwards_per_step: int) -> None:
    started = [0.0]

    def before(module: nn.Module, args: object) -> None:
        started[0] = time.perf_counter()

    def after(module: nn.Module, args: object, output: object) -> None:
        if next(forwards) // forwards_per_step >= fault.step:
            time.sleep((fault.factor - 1) * (time.perf_counter() - started[0]))

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)
