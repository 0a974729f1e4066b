"""The fused operators as torch custom ops (torch.ops.mshpc.*, defined in csrc/binding/ops.cpp):
their autograd formulas and fake implementations, so that autograd and torch.compile see
through them, and Python functions with the signatures of mshpc.kernels.reference.

Import-safe without the library; `register()` runs once it is loaded (mshpc.kernels.build).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mshpc.kernels.reference import compute_dtype

mshpc_ops: Any = torch.ops.mshpc

# ---------------------------------------------------------------- the model's operators


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused mshpc.kernels.reference.add_rms_norm."""
    y, s, _, _ = mshpc_ops.add_norm(x, residual, weight, None, eps, True)
    return y, (x if residual is None else s)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused mshpc.kernels.reference.add_layer_norm."""
    y, s, _, _ = mshpc_ops.add_norm(x, residual, weight, bias, eps, False)
    return y, (x if residual is None else s)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Fused mshpc.kernels.reference.bias_gelu."""
    return mshpc_ops.bias_gelu(x, bias)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """Fused mshpc.kernels.reference.swiglu."""
    return mshpc_ops.swiglu(x)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Fused mshpc.kernels.reference.rope; x may be strided (a slice of the qkv projection) as
    long as its last dim is contiguous; the result is contiguous."""
    return mshpc_ops.rope(x, cos, sin, False)


def moe_permute(x: torch.Tensor, pos: torch.Tensor, rows: int) -> torch.Tensor:
    """Fused mshpc.kernels.reference.moe_permute."""
    return mshpc_ops.moe_permute(x, pos, rows)


def moe_unpermute(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Fused mshpc.kernels.reference.moe_unpermute."""
    return mshpc_ops.moe_unpermute(y, pos, w)


# ---------------------------------------------------------------- autograd


def _add_norm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, residual, weight, bias, _, rms = inputs
    _, s, mean, rstd = output
    ctx.save_for_backward(x if residual is None else s, weight, mean, rstd)
    ctx.rms = rms
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype, None if bias is None else bias.dtype)
    ctx.mark_non_differentiable(mean, rstd)


def _add_norm_backward(ctx: Any, dy: torch.Tensor, dsum: torch.Tensor, *_: Any) -> tuple:
    s, weight, mean, rstd = ctx.saved_tensors
    x_dtype, res_dtype, bias_dtype = ctx.dtypes
    # without a residual the sum output is an empty placeholder: its gradient carries nothing
    dx, dweight, dbias = mshpc_ops.add_norm_backward(
        dy, dsum if res_dtype is not None else None, s, weight, mean, rstd, ctx.rms)
    return (dx.to(x_dtype), None if res_dtype is None else dx.to(res_dtype), dweight,
            None if bias_dtype is None else dbias.to(bias_dtype), None, None)


def _bias_gelu_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, bias = inputs
    ctx.save_for_backward(x, bias)


def _bias_gelu_backward(ctx: Any, dy: torch.Tensor) -> tuple:
    x, bias = ctx.saved_tensors
    dx, dbias = mshpc_ops.bias_gelu_backward(dy, x, bias)
    return dx, (None if bias is None else dbias)


def _swiglu_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _swiglu_backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return mshpc_ops.swiglu_backward(dy, x)


def _rope_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse, ctx.x_dtype = inverse, x.dtype


def _rope_backward(ctx: Any, dy: torch.Tensor) -> tuple:
    cos, sin = ctx.saved_tensors
    # a rotation's transpose is the rotation by minus the angle
    return mshpc_ops.rope(dy.to(ctx.x_dtype), cos, sin, not ctx.inverse), None, None, None


def _moe_permute_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[1])


def _moe_permute_backward(ctx: Any, dxp: torch.Tensor) -> tuple:
    (pos,) = ctx.saved_tensors
    return mshpc_ops.moe_permute_backward(dxp, pos), None, None


def _moe_unpermute_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    y, pos, w = inputs
    ctx.save_for_backward(y, pos, w)


def _moe_unpermute_backward(ctx: Any, dout: torch.Tensor) -> tuple:
    y, pos, w = ctx.saved_tensors
    dy, dw = mshpc_ops.moe_unpermute_backward(dout, y, pos, w)
    return dy, None, dw.to(w.dtype)


# ---------------------------------------------------------------- fake (meta) implementations


def _add_norm_fake(x, residual, weight, bias, eps, rms):
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    rows = x.numel() // weight.numel()
    acc = compute_dtype(dtype)
    return (x.new_empty(x.shape, dtype=dtype),
            x.new_empty(x.shape if residual is not None else (0,), dtype=dtype),
            x.new_empty((0 if rms else rows,), dtype=acc), x.new_empty((rows,), dtype=acc))


def _add_norm_backward_fake(dy, dsum, s, weight, mean, rstd, rms):
    acc = compute_dtype(s.dtype)
    return (torch.empty_like(s, memory_format=torch.contiguous_format), torch.empty_like(weight),
            s.new_empty((0,) if rms else (weight.numel(),), dtype=acc))


def _bias_gelu_fake(x, bias):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _bias_gelu_backward_fake(dy, x, bias):
    dbias = x.new_empty((0,)) if bias is None else torch.empty_like(bias)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dbias


def _swiglu_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _swiglu_backward_fake(dy, x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rope_fake(x, cos, sin, inverse):
    return x.new_empty(x.shape)


def _moe_permute_fake(x, pos, rows):
    return x.new_empty((rows, x.shape[1]))


def _moe_permute_backward_fake(dxp, pos):
    return dxp.new_empty((pos.shape[0], dxp.shape[1]))


def _moe_unpermute_fake(y, pos, w):
    return y.new_empty((pos.shape[0], y.shape[1]))


def _moe_unpermute_backward_fake(dout, y, pos, w):
    return torch.empty_like(y, memory_format=torch.contiguous_format), pos.new_empty(pos.shape, dtype=compute_dtype(y.dtype))


def _lamb_direction_fake(params, grads, exp_avgs, exp_avg_sqs, weight_decays, beta1, beta2, eps, step):
    return torch.empty((len(params), 2), dtype=torch.float32,
                       device=params[0].device if params else "cpu")


@functools.cache
def register() -> None:
    """Attach the autograd formulas and fake implementations to the loaded operators (once)."""
    lib = torch.library
    lib.register_fake("mshpc::add_norm")(_add_norm_fake)
    lib.register_fake("mshpc::add_norm_backward")(_add_norm_backward_fake)
    lib.register_fake("mshpc::bias_gelu")(_bias_gelu_fake)
    lib.register_fake("mshpc::bias_gelu_backward")(_bias_gelu_backward_fake)
    lib.register_fake("mshpc::swiglu")(_swiglu_fake)
    lib.register_fake("mshpc::swiglu_backward")(_swiglu_backward_fake)
    lib.register_fake("mshpc::rope")(_rope_fake)
    lib.register_fake("mshpc::moe_permute")(_moe_permute_fake)
    lib.register_fake("mshpc::moe_permute_backward")(_moe_permute_backward_fake)
    lib.register_fake("mshpc::moe_unpermute")(_moe_unpermute_fake)
    lib.register_fake("mshpc::moe_unpermute_backward")(_moe_unpermute_backward_fake)
    lib.register_fake("mshpc::multi_tensor_adamw")(lambda *args: None)
    lib.register_fake("mshpc::multi_tensor_lamb_direction")(_lamb_direction_fake)
    lib.register_fake("mshpc::multi_tensor_lamb_apply")(lambda *args: None)
    lib.register_autograd("mshpc::add_norm", _add_norm_backward, setup_context=_add_norm_setup)
    lib.register_autograd("mshpc::bias_gelu", _bias_gelu_backward, setup_context=_bias_gelu_setup)
    lib.register_autograd("mshpc::swiglu", _swiglu_backward, setup_context=_swiglu_setup)
    lib.register_autograd("mshpc::rope", _rope_backward, setup_context=_rope_setup)
    lib.register_autograd("mshpc::moe_permute", _moe_permute_backward, setup_context=_moe_permute_setup)
    lib.register_autograd("mshpc::moe_unpermute", _moe_unpermute_backward, setup_context=_moe_unpermute_setup)
