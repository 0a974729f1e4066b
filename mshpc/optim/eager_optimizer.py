"""torch.optim.Optimizer without the import of torch._dynamo that its first use costs.

torch wraps the base class's add_param_group, zero_grad, state_dict and load_state_dict in
torch._disable_dynamo, which imports torch._dynamo on the first call: about 2 s of CPU per
process (as long again as `import torch`), paid by every rank of every run that builds an
optimizer, although nothing is compiled. The guard only matters while torch.compile traces,
and tracing needs torch._dynamo loaded; so, while it is not loaded, these methods call torch's
own code undecorated, and once it is (by torch.compile or anyone), the decorated one as before.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

_Base = torch.optim.Optimizer


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


class EagerOptimizer(_Base):
    """The base of mshpc's own optimizers (FusedAdamW, Lamb): torch's Optimizer, the same
    behaviour, without loading torch._dynamo before anything else has."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if _dynamo_loaded():
            return _Base.add_param_group(self, param_group)
        return _Base.add_param_group.__wrapped__(self, param_group)  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _dynamo_loaded():
            return _Base.zero_grad(self, set_to_none)
        return _Base.zero_grad.__wrapped__(self, set_to_none)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        if _dynamo_loaded():
            return _Base.state_dict(self)
        return _Base.state_dict.__wrapped__(self)  # type: ignore[attr-defined]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _dynamo_loaded():
            return _Base.load_state_dict(self, state_dict)
        return _Base.load_state_dict.__wrapped__(self, state_dict)  # type: ignore[attr-defined]
