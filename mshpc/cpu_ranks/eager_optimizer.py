"""torch.optim.Optimizer without the import of torch._dynamo that its first use costs, on CPU
ranks (tunings.py turns it on at start-up; elsewhere these are torch's own methods).

torch wraps the base class's add_param_group, zero_grad, state_dict and load_state_dict in
torch._disable_dynamo, which imports torch._dynamo on the first call: about 2 s of CPU per
process (as long again as `import torch`), paid by every rank of every run that builds an
optimizer, although nothing is compiled; on a host whose cores are the ranks' compute, that is
2 s of every rank's start. The guard only matters while torch.compile traces, and tracing needs
torch._dynamo loaded; so, while it is not loaded, these methods call torch's own code
undecorated (its private `__wrapped__`), and once it is, the decorated one as before.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

_Base = torch.optim.Optimizer
_enabled = False  # set once per process by tunings.select_cpu_tunings


def enable_eager_optimizer() -> None:
    """From now on in this process, mshpc's optimizers skip torch._dynamo while it is not loaded."""
    global _enabled
    _enabled = True


def _guarded() -> bool:
    """Whether torch's decorated methods run: the shortcut is off, or torch._dynamo is loaded."""
    return not _enabled or "torch._dynamo" in sys.modules


class EagerOptimizer(_Base):
    """The base of mshpc's own optimizers (FusedAdamW, Lamb): torch's Optimizer, the same
    behaviour; on a CPU rank, without loading torch._dynamo before anything else has."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if _guarded():
            return _Base.add_param_group(self, param_group)
        return _Base.add_param_group.__wrapped__(self, param_group)  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _guarded():
            return _Base.zero_grad(self, set_to_none)
        return _Base.zero_grad.__wrapped__(self, set_to_none)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        if _guarded():
            return _Base.state_dict(self)
        return _Base.state_dict.__wrapped__(self)  # type: ignore[attr-defined]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _guarded():
            return _Base.load_state_dict(self, state_dict)
        return _Base.load_state_dict.__wrapped__(self, state_dict)  # type: ignore[attr-defined]
