"""Fault injection for tests: the train loop honours MSHPC_TEST_FAULTS, read by launch/env.py.

Spec: `;`-separated faults, each `KIND:rank=R:step=S`, KIND one of
  raise  raise RuntimeError in the step (a Python crash with a traceback)
  kill   SIGKILL this rank (a crash with no chance to clean up)
  kill_in_save  SIGKILL this rank in stage 2 of the save of step S, after every shard is
                written and before rank 0 commits (so on rank 0 the save is never committed)
and, honoured by `mshpc preflight` (no step: `KIND:rank=R`),
  gemm_slow   this rank's GEMMs take SLOW_FACTOR times as long (the device tests and the burn)
  gemm_wrong  one element of each GEMM result on this rank is wrong (silent data corruption)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from mshpc.errors import ConfigError

KINDS = ("raise", "kill", "kill_in_save", "gemm_slow", "gemm_wrong")
_PHASE = {"raise": "step", "kill": "step", "kill_in_save": "save", "gemm_slow": "preflight", "gemm_wrong": "preflight"}
SLOW_FACTOR = 4  # gemm_slow: each GEMM runs this many times and counts once


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0


def _parse_one(text: str) -> Fault:
    kind, *fields = text.strip().split(":")
    values = dict(f.split("=", 1) for f in fields if "=" in f)
    fields = {"rank"} if _PHASE.get(kind) == "preflight" else {"rank", "step"}
    if kind not in KINDS or set(values) != fields:
        raise ConfigError(f"MSHPC_TEST_FAULTS entry {text!r} must be KIND:rank=R:step=S, KIND in {', '.join(KINDS)}")
    try:
        return Fault(kind, int(values["rank"]), int(values.get("step", 0)))
    except ValueError:
        raise ConfigError(f"MSHPC_TEST_FAULTS entry {text!r}: rank and step must be integers") from None


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
