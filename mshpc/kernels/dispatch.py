"""The one-time choice between the fused kernels and the pure-torch references.

`select_kernels(model.fused_kernels)` decides once per process and mode and logs one line
saying what it chose and why; the model holds the returned `Kernels` and calls its functions,
which have the same signatures either way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mshpc.errors import KernelError
from mshpc.kernels import build, ops, reference

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """The model's operators: fused (mshpc.kernels.ops) or reference (mshpc.kernels.reference)."""

    fused: bool
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    add_layer_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    bias_gelu: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    swiglu: Callable[[torch.Tensor], torch.Tensor]
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    moe_permute: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    moe_unpermute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


REFERENCE = Kernels(False, reference.add_rms_norm, reference.add_layer_norm, reference.bias_gelu, reference.swiglu,
                    reference.rope, reference.moe_permute, reference.moe_unpermute)
FUSED = Kernels(True, ops.add_rms_norm, ops.add_layer_norm, ops.bias_gelu, ops.swiglu, ops.rope, ops.moe_permute,
                ops.moe_unpermute)


@functools.cache
def select_kernels(mode: str) -> Kernels:
    """FUSED or REFERENCE for model.fused_kernels = `mode`: "off" never builds; "auto" builds (or
    loads the cached build) and falls back to the references if it cannot; "on" raises a one-line
    KernelError instead. Cached: each process builds, chooses and logs once per mode."""
    if mode == "off":
        log.info("fused kernels: off (model.fused_kernels=off): pure-torch reference operators")
        return REFERENCE
    try:
        loaded = build.load()
    except KernelError as exc:
        if mode == "on":
            raise KernelError(f"model.fused_kernels=on, but the kernels cannot be built: {exc} "
                              "(choose 'auto' to fall back to the pure-torch operators, or 'off')") from None
        log.warning("fused kernels: unavailable, using the pure-torch reference operators "
                    "(model.fused_kernels=auto): %s", exc)
        return REFERENCE
    kind = "CUDA kernels + CPU twins" if loaded.cuda else "CPU twins (no CUDA here)"
    how = "the kept library" if loaded.kept else "cpp_extension"
    log.info("fused kernels: on (model.fused_kernels=%s): %s, ready in %.1f s from %s (%s)",
             mode, kind, loaded.built_s, loaded.library.parent, how)
    return FUSED
