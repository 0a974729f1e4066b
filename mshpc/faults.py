"""Fault injection for tests: the train loop honours MSHPC_TEST_FAULTS, read by launch/env.py.

Spec: `;`-separated faults, each `KIND:rank=R:step=S`, KIND one of
  raise  raise RuntimeError in the step (a Python crash with a traceback)
  kill   SIGKILL this rank (a crash with no chance to clean up)
  kill_in_save  SIGKILL this rank in stage 2 of the save of step S, after every shard is
                written and before rank 0 commits (so on rank 0 the save is never committed)
  slow   from step S on, each forward on rank R takes `factor` times as long, a sleep after it
         (a slower device): `slow:rank=R:step=S:factor=F`, F >= 1
and, honoured by `mshpc preflight` (no step: `KIND:rank=R`),
  gemm_slow   this rank's GEMMs take SLOW_FACTOR times as long (the device tests and the burn)
  gemm_wrong  one element of each GEMM result on this rank is wrong (silent data corruption)
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass

from torch import nn

from mshpc.errors import ConfigError

KINDS = ("raise", "kill", "kill_in_save", "slow", "gemm_slow", "gemm_wrong")
_PHASE = {"raise": "step", "kill": "step", "kill_in_save": "save", "slow": "forward",
          "gemm_slow": "preflight", "gemm_wrong": "preflight"}
# the fields each kind takes; the others: rank and step
_FIELDS = {"slow": {"rank", "step", "factor"}, "gemm_slow": {"rank"}, "gemm_wrong": {"rank"}}
SLOW_FACTOR = 4  # gemm_slow: each GEMM runs this many times and counts once


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0
    factor: float = 1.0  # slow: how many times as long each forward takes


def _parse_one(text: str) -> Fault:
    kind, *fields = text.strip().split(":")
    values = dict(f.split("=", 1) for f in fields if "=" in f)
    if kind not in KINDS or set(values) != _FIELDS.get(kind, {"rank", "step"}):
        raise ConfigError(f"MSHPC_TEST_FAULTS entry {text!r} must be KIND:rank=R:step=S "
                          f"(slow: also :factor=F; gemm_*: no step), KIND in {', '.join(KINDS)}")
    try:
        fault = Fault(kind, int(values["rank"]), int(values.get("step", 0)), float(values.get("factor", 1.0)))
    except ValueError:
        raise ConfigError(f"MSHPC_TEST_FAULTS entry {text!r}: rank and step must be integers, "
                          "factor a number") from None
    if fault.factor < 1:
        raise ConfigError(f"MSHPC_TEST_FAULTS entry {text!r}: factor must be >= 1")
    return fault


def parse_faults(spec: str | None) -> tuple[Fault, ...]:
    return tuple(_parse_one(part) for part in (spec or "").split(";") if part.strip())


def inject(faults: tuple[Fault, ...], rank: int, step: int, phase: str = "step") -> None:
    """Fire the faults planned for this rank at this step (0-based) and phase, if any."""
    for fault in faults:
        if fault.rank != rank or fault.step != step or _PHASE[fault.kind] != phase:
            continue
        if fault.kind in ("kill", "kill_in_save"):
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault at rank {rank} step {step}")


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
