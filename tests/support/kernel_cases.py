"""Inputs and comparisons shared by the kernel tests on CPU (tests/unit/kernels) and on CUDA
(tests/gpu): the same cases, on either device.

Tolerances: float64 agrees to rounding (1e-12); float32 to a few ulps (1e-5), the kernels
summing in another order than torch; bfloat16 and float16 to one ulp of the storage type (2^-7,
2^-10 relative), since kernel and reference both compute in float32 and round once, and a
different summation order can move a value across a rounding boundary.

Long reductions (a norm's weight gradient sums 1,400 rows; its input gradient a 4,100-wide dot
product) lose more than a few ulps to summation order alone, in torch's result as much as in the
kernel's. There the kernel passes when it is as close to the float64 truth as torch is in the
same dtype (within 2x and one tolerance step: the criterion of flash-attention's tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mshpc.kernels import ops, reference

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=2**-7),
    torch.float16: dict(rtol=2**-10, atol=2**-10),
}
EPS = 1e-5
NORMS = {"rms": (ops.add_rms_norm, reference.add_rms_norm), "layer": (ops.add_layer_norm, reference.add_layer_norm)}


def rand(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0, grad: bool = False,
         device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_(grad)


def norm_args(kind: str, dtype: torch.dtype, residual: bool, grad: bool = False, d: int = 96,
              rows: int = 7, device: str = "cpu") -> tuple:
    """x (2, rows, d) and its operands; the default width is not a multiple of a vector length."""
    x = rand(2, rows, d, dtype=dtype, seed=1, grad=grad, device=device)
    r = rand(2, rows, d, dtype=dtype, seed=2, grad=grad, device=device) if residual else None
    w = (1 + 0.1 * rand(d, seed=3, device=device)).to(dtype).requires_grad_(grad)
    if kind == "rms":
        return x, r, w, EPS
    return x, r, w, (0.1 * rand(d, seed=4, device=device)).to(dtype).requires_grad_(grad), EPS


def gelu_args(dtype: torch.dtype, bias: bool, grad: bool = False, shape: tuple = (4, 5, 72),
              device: str = "cpu") -> tuple:
    x = (3 * rand(*shape, seed=6, device=device)).to(dtype).requires_grad_(grad)
    b = rand(shape[-1], dtype=dtype, seed=7, grad=grad, device=device) if bias else None
    return x, b


def swiglu_args(dtype: torch.dtype, grad: bool = False, shape: tuple = (4, 5, 2 * 36),
                device: str = "cpu") -> torch.Tensor:
    """fc's output [gate | up]; the gate width (36) is not a multiple of a vector length, and the
    spread (3 sigma) reaches where sigmoid saturates."""
    return (3 * rand(*shape, seed=11, device=device)).to(dtype).requires_grad_(grad)


def qkv_slice(dtype: torch.dtype, grad: bool = False, shape: tuple = (2, 6, 3, 3, 16),
              device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the model hands them to rope: a strided (b, s, 2 * nh, hd) view of qkv."""
    qkv = rand(*shape, dtype=dtype, seed=10, grad=grad, device=device)  # (b, s, 3, nh, hd)
    return qkv, qkv[:, :, :2].flatten(2, 3)


def tables(dtype: torch.dtype = torch.float32, device: str = "cpu", head_dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for 8 positions (head dim 16): longer than the inputs, as the model's are."""
    from mshpc.model.attention import rope_cache

    return rope_cache(8, head_dim, 10000.0, device=device, dtype=dtype)


def grads_of(fn: Callable, args: tuple, seed: int = 9) -> list[torch.Tensor]:
    """Gradients of a fixed random projection of fn's outputs with respect to args."""
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * rand(*o.shape, seed=seed + i, device=o.device)).sum() for i, o in enumerate(outs))
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return list(torch.autograd.grad(loss, tensors))


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype])


def assert_as_close_as_torch(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor,
                             dtype: torch.dtype) -> None:
    """got within TOL of want; failing that, no further from the float64 truth than torch's own
    result in the same dtype (want), within 2x plus the tolerance."""
    try:
        assert_close(got, want, dtype)
    except AssertionError:
        err_got = (got.double() - truth).abs().max().item()
        err_torch = (want.double() - truth).abs().max().item()
        assert err_got <= 2 * err_torch + TOL[dtype]["atol"], (
            f"kernel error {err_got:.3g} against float64, torch's {err_torch:.3g} ({dtype})")


def in_float64(args: tuple) -> tuple:
    return tuple(a.detach().double().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args)


def check_norm(kind: str, residual: bool, dtype: torch.dtype, device: str = "cpu", **shape: int) -> None:
    """Fused add+norm against its reference: outputs and every gradient."""
    fused, ref = NORMS[kind]
    args = norm_args(kind, dtype, residual, grad=True, device=device, **shape)
    (y, s), (y_ref, s_ref) = fused(*args), ref(*args)
    exact = in_float64(args)
    assert_as_close_as_torch(y, y_ref, ref(*exact)[0], dtype)
    assert torch.equal(s, s_ref)  # one rounding of the same sum
    truths = grads_of(ref, exact)
    for got, want, truth in zip(grads_of(fused, args), grads_of(ref, args), truths):
        assert_as_close_as_torch(got, want, truth, dtype)


def check_bias_gelu(bias: bool, dtype: torch.dtype, device: str = "cpu", shape: tuple = (4, 5, 72)) -> None:
    """Fused bias+GeLU against its reference; the bias gradient sums every row, so it passes as
    close to the float64 truth as torch's own (as check_norm's weight gradients)."""
    args = gelu_args(dtype, bias, grad=True, shape=shape, device=device)
    assert_close(ops.bias_gelu(*args), reference.bias_gelu(*args), dtype)
    truths = grads_of(reference.bias_gelu, in_float64(args))
    for got, want, truth in zip(grads_of(ops.bias_gelu, args), grads_of(reference.bias_gelu, args), truths):
        assert_as_close_as_torch(got, want, truth, dtype)


def check_swiglu(dtype: torch.dtype, device: str = "cpu") -> None:
    """Fused gate against its reference: the output (half of x's last dim) and x's gradient."""
    x = swiglu_args(dtype, grad=True, device=device)
    y = ops.swiglu(x)
    assert y.shape == (*x.shape[:-1], x.shape[-1] // 2)
    assert_close(y, reference.swiglu(x), dtype)
    assert_close(grads_of(ops.swiglu, (x,))[0], grads_of(reference.swiglu, (x,))[0], dtype)


def check_rope(dtype: torch.dtype, device: str = "cpu", head_dim: int = 16) -> None:
    """On the strided q/k view of qkv, as the model calls it; v's gradient stays zero."""
    qkv, qk = qkv_slice(dtype, grad=True, shape=(2, 6, 3, 3, head_dim), device=device)
    assert not qk.is_contiguous()
    cos, sin = tables(device=device, head_dim=head_dim)
    out = ops.rope(qk, cos, sin)
    assert out.is_contiguous()
    assert_close(out, reference.rope(qk, cos, sin), dtype)
    got = grads_of(lambda t: ops.rope(t[:, :, :2].flatten(2, 3), cos, sin), (qkv,))[0]
    want = grads_of(lambda t: reference.rope(t[:, :, :2].flatten(2, 3), cos, sin), (qkv,))[0]
    assert_close(got, want, dtype)
    assert torch.equal(got[:, :, 2], torch.zeros_like(got[:, :, 2]))


def check_mixed_norm(kind: str, device: str = "cpu") -> None:
    """Under autocast a block's branch output is bf16 and the residual stream fp32: the sum and
    the norm are fp32, and x's gradient comes back in bf16."""
    fused, ref = NORMS[kind]
    args = list(norm_args(kind, torch.float32, True, grad=True, device=device))
    args[0] = rand(2, 7, 96, dtype=torch.bfloat16, seed=5, grad=True, device=device)
    (y, s), (y_ref, _) = fused(*args), ref(*args)
    assert y.dtype == s.dtype == torch.float32
    assert_close(y, y_ref, torch.float32)
    got, want = grads_of(fused, tuple(args)), grads_of(ref, tuple(args))
    assert got[0].dtype == torch.bfloat16
    for g, w in zip(got, want):
        assert_close(g, w, g.dtype)


def check_mixed_bias_gelu(device: str = "cpu") -> None:
    """Autocast: fc's output is bf16, the bias parameter fp32; the result keeps x's dtype."""
    x = rand(4, 72, dtype=torch.bfloat16, seed=8, grad=True, device=device)
    b = rand(72, dtype=torch.float32, seed=9, grad=True, device=device)
    y = ops.bias_gelu(x, b)
    assert y.dtype == torch.bfloat16
    assert_close(y, reference.bias_gelu(x, b), torch.bfloat16)
    got, want = grads_of(ops.bias_gelu, (x, b)), grads_of(reference.bias_gelu, (x, b))
    assert got[1].dtype == torch.float32
    assert_close(got[0], want[0], torch.bfloat16)
    assert_close(got[1], want[1], torch.float32)


def moe_args(dtype: torch.dtype, grad: bool = False, tokens: int = 9, k: int = 3, d: int = 36,
             drop: int = 4, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(x (tokens, d), pos (tokens, k), w (tokens, k) fp32 (fp64 for fp64), rows): a random order of
    the copies with `drop` of them dropped (-1); the width is not a multiple of a vector length."""
    g = torch.Generator().manual_seed(12)
    n = tokens * k
    kept = torch.randperm(n, generator=g)[: n - drop]  # which copies the capacity keeps
    pos = torch.full((n,), -1, dtype=torch.long)
    pos[kept] = torch.randperm(n - drop, generator=g)
    x = rand(tokens, d, dtype=dtype, seed=13, grad=grad, device=device)
    w = torch.rand(tokens, k, generator=g, dtype=torch.float64).to(device, reference.compute_dtype(dtype))
    return x, pos.view(tokens, k).to(device), w.requires_grad_(grad), n - drop


def check_moe_permute(dtype: torch.dtype, device: str = "cpu", **shape: int) -> None:
    """Fused permute and unpermute against their references: outputs, and the gradients of x,
    of the expert outputs y and of the router's weights w."""
    x, pos, w, rows = moe_args(dtype, grad=True, device=device, **shape)
    xp = ops.moe_permute(x, pos, rows)
    assert torch.equal(xp, reference.moe_permute(x, pos, rows))  # a copy: bitwise
    got = grads_of(lambda t: ops.moe_permute(t, pos, rows), (x,))[0]
    want = grads_of(lambda t: reference.moe_permute(t, pos, rows), (x,))[0]
    assert_close(got, want, dtype)
    y = rand(rows, x.shape[1], dtype=dtype, seed=14, grad=True, device=device)
    assert_close(ops.moe_unpermute(y, pos, w), reference.moe_unpermute(y, pos, w), dtype)
    got = grads_of(lambda a, b: ops.moe_unpermute(a, pos, b), (y, w))
    want = grads_of(lambda a, b: reference.moe_unpermute(a, pos, b), (y, w))
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, g.dtype)
