"""Every fused operator against its pure-torch reference (mshpc.kernels.reference): forward,
gradients (gradcheck in float64), strided inputs, mixed dtypes, and what torch.compile needs.

Tolerances: float64 agrees to rounding (1e-12); float32 to a few ulps (1e-5), the kernels
summing in another order than torch; bfloat16 and float16 to one ulp of the storage type (2^-7,
2^-10 relative), since kernel and reference both compute in float32 and round once, and a
different summation order can move a value across a rounding boundary.
"""

from __future__ import annotations

import pytest
import torch

from mshpc.kernels import ops, reference

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=2**-7),
    torch.float16: dict(rtol=2**-10, atol=2**-10),
}
DTYPES = list(TOL)
EPS = 1e-5


def rand(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0, grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)


def norm_args(kind: str, dtype: torch.dtype, residual: bool, grad: bool = False, d: int = 96,
              rows: int = 7) -> tuple:
    """x (2, rows, d) and its operands; the default width is not a multiple of a vector length."""
    x = rand(2, rows, d, dtype=dtype, seed=1, grad=grad)
    r = rand(2, rows, d, dtype=dtype, seed=2, grad=grad) if residual else None
    w = (1 + 0.1 * rand(d, seed=3)).to(dtype).requires_grad_(grad)
    if kind == "rms":
        return x, r, w, EPS
    return x, r, w, (0.1 * rand(d, seed=4)).to(dtype).requires_grad_(grad), EPS


NORMS = {"rms": (ops.add_rms_norm, reference.add_rms_norm), "layer": (ops.add_layer_norm, reference.add_layer_norm)}


def grads_of(fn, args: tuple, seed: int = 9) -> list[torch.Tensor | None]:
    """Gradients of a fixed random projection of fn's outputs with respect to args."""
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * rand(*o.shape, seed=seed + i)).sum() for i, o in enumerate(outs))
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return list(torch.autograd.grad(loss, tensors))


def assert_close(got, want, dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kind", list(NORMS))
def test_add_norm_matches_reference(kind, residual, dtype):
    fused, ref = NORMS[kind]
    args = norm_args(kind, dtype, residual, grad=True)
    (y, s), (y_ref, s_ref) = fused(*args), ref(*args)
    assert_close(y, y_ref, dtype)
    assert torch.equal(s, s_ref)  # one rounding of the same sum
    for got, want in zip(grads_of(fused, args), grads_of(ref, args)):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kind", list(NORMS))
def test_add_norm_gradcheck(kind, residual):
    # small: gradcheck's numerical Jacobian costs a forward per input element
    args = norm_args(kind, torch.float64, residual, grad=True, d=19, rows=3)
    assert torch.autograd.gradcheck(NORMS[kind][0], args)


@pytest.mark.parametrize("kind", list(NORMS))
def test_bf16_branch_into_fp32_stream(kind):
    # under autocast a block's branch output is bf16 and the residual stream fp32: the sum and the
    # norm are fp32, and x's gradient comes back in bf16
    fused, ref = NORMS[kind]
    args = list(norm_args(kind, torch.float32, True, grad=True))
    args[0] = rand(2, 7, 96, dtype=torch.bfloat16, seed=5, grad=True)
    (y, s), (y_ref, s_ref) = fused(*args), ref(*args)
    assert y.dtype == s.dtype == torch.float32
    assert_close(y, y_ref, torch.float32)
    got, want = grads_of(fused, tuple(args)), grads_of(ref, tuple(args))
    assert got[0].dtype == torch.bfloat16
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32 if g.dtype == torch.float32 else torch.bfloat16)


def gelu_args(dtype: torch.dtype, bias: bool, grad: bool = False, shape: tuple = (4, 5, 72)) -> tuple:
    x = (3 * rand(*shape, dtype=torch.float64, seed=6)).to(dtype).requires_grad_(grad)
    b = rand(shape[-1], dtype=dtype, seed=7, grad=grad) if bias else None
    return x, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bias_gelu_matches_reference(bias, dtype):
    args = gelu_args(dtype, bias, grad=True)
    assert_close(ops.bias_gelu(*args), reference.bias_gelu(*args), dtype)
    for got, want in zip(grads_of(ops.bias_gelu, args), grads_of(reference.bias_gelu, args)):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("bias", [False, True])
def test_bias_gelu_gradcheck(bias):
    assert torch.autograd.gradcheck(ops.bias_gelu, gelu_args(torch.float64, bias, grad=True, shape=(3, 19)))


def test_bias_gelu_fp32_bias_on_bf16_input():
    # autocast: fc's output is bf16, the bias parameter fp32; the result keeps x's dtype
    x, b = rand(4, 72, dtype=torch.bfloat16, seed=8, grad=True), rand(72, seed=9).float().requires_grad_()
    y = ops.bias_gelu(x, b)
    assert y.dtype == torch.bfloat16
    assert_close(y, reference.bias_gelu(x, b), torch.bfloat16)
    got, want = grads_of(ops.bias_gelu, (x, b)), grads_of(reference.bias_gelu, (x, b))
    assert got[1].dtype == torch.float32
    assert_close(got[0], want[0], torch.bfloat16)
    assert_close(got[1], want[1], torch.float32)


def qkv_slice(dtype: torch.dtype, grad: bool = False, shape: tuple = (2, 6, 3, 3, 16)) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the model hands them to rope: a strided (b, s, 2 * nh, hd) view of qkv."""
    qkv = rand(*shape, dtype=dtype, seed=10, grad=grad)  # (b, s, 3, nh, hd)
    return qkv, qkv[:, :, :2].flatten(2, 3)


def tables(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    from mshpc.model.attention import rope_cache

    return rope_cache(8, 16, 10000.0, dtype=dtype)  # longer than the input: the first 6 rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_reference_on_a_strided_view(dtype):
    qkv, qk = qkv_slice(dtype, grad=True)
    assert not qk.is_contiguous()
    cos, sin = tables()
    out = ops.rope(qk, cos, sin)
    assert out.is_contiguous()
    assert_close(out, reference.rope(qk, cos, sin), dtype)
    want = grads_of(lambda q: reference.rope(q[:, :, :2].flatten(2, 3), cos, sin), (qkv,))
    got = grads_of(lambda q: ops.rope(q[:, :, :2].flatten(2, 3), cos, sin), (qkv,))
    assert_close(got[0], want[0], dtype)
    assert torch.equal(got[0][:, :, 2], torch.zeros_like(got[0][:, :, 2]))  # v is not rotated


def test_rope_gradcheck():
    cos, sin = tables(torch.float64)
    qkv, _ = qkv_slice(torch.float64, grad=True, shape=(1, 3, 3, 2, 16))
    assert torch.autograd.gradcheck(lambda t: ops.rope(t[:, :, :2].flatten(2, 3), cos, sin), (qkv,))


def test_opcheck_and_compile():
    """The schemas, fake implementations and autograd registrations pass torch's own checks, and
    torch.compile traces the ops whole (fullgraph) with the same results."""
    cos, sin = tables()
    _, qk = qkv_slice(torch.float32, grad=True)
    x, r, w, b, _ = norm_args("layer", torch.float32, True, grad=True)
    samples = [
        (torch.ops.mshpc.add_norm, (x, r, w, b, EPS, False)),
        (torch.ops.mshpc.add_norm, (x, None, w, None, EPS, True)),
        (torch.ops.mshpc.bias_gelu, gelu_args(torch.float32, True, grad=True)),
        (torch.ops.mshpc.rope, (qk, cos, sin, False)),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args)

    def block(x, r, w, b, qk):
        h, s = ops.add_layer_norm(x, r, w, b, EPS)
        return ops.bias_gelu(h, b) + s, ops.rope(qk, cos, sin)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    args = (x, r, w, b, qk)
    for got, want in zip(compiled(*args), block(*args)):
        torch.testing.assert_close(got, want)
    for got, want in zip(grads_of(compiled, args), grads_of(block, args)):
        torch.testing.assert_close(got, want)


def test_bad_inputs_fail_with_one_line():
    with pytest.raises(RuntimeError, match="mshpc::add_norm: x's last dim must be 96"):
        ops.add_rms_norm(rand(3, 95).float(), None, rand(96).float(), EPS)
    with pytest.raises(RuntimeError, match="mshpc::rope: x must be"):
        ops.rope(rand(3, 8).float(), *tables())
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.bias_gelu(torch.ones(4, dtype=torch.int32), None)
