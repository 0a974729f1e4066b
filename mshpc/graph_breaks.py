"""Functions that run eagerly between a compiled block's graphs (`torch.compiler.disable`),
marked when `train.compile` first compiles rather than when their module is imported:
`torch.compiler.disable` imports torch._dynamo, ~1.4 CPU-s at every rank's start, which a run
that compiles nothing never needs (the same saving as cpu_ranks/eager_optimizer.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_marked: list[tuple[Any, str]] = []  # (module or class, attribute) to wrap before compiling
_applied = False


class _Method(Generic[F]):
    """Stands in a class body until the class exists, then registers (class, name) and puts the
    plain function back: the class behaves as if undecorated until `apply` runs."""

    def __init__(self, fn: F) -> None:
        self.fn = fn

    def __set_name__(self, owner: type, name: str) -> None:
        setattr(owner, name, self.fn)
        _marked.append((owner, name))
        if _applied:  # a class defined after compiling began
            setattr(owner, name, torch.compiler.disable(self.fn))


def eager_method(fn: F) -> F:
    """`torch.compiler.disable` for a method, applied by `apply`."""
    return _Method(fn)  # type: ignore[return-value]  # replaced by fn itself in __set_name__


def eager_function(fn: F) -> F:
    """`torch.compiler.disable` for a module-level function, applied by `apply`: callers must look
    it up by name in its module at call time (no `from module import fn` elsewhere)."""
    if _applied:
        return torch.compiler.disable(fn)
    _marked.append((sys.modules[fn.__module__], fn.__name__))
    return fn


def apply() -> None:
    """Wrap every marked function in `torch.compiler.disable`; once per process, before the first
    torch.compile (parallel/compile_blocks.py)."""
    global _applied
    if _applied:
        return
    _applied = True
    for owner, name in _marked:
        setattr(owner, name, torch.compiler.disable(getattr(owner, name)))
