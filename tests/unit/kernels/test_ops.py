"""Every fused operator against its pure-torch reference (mshpc.kernels.reference) on CPU:
forward, gradients (gradcheck in float64), strided inputs, mixed dtypes, and what torch.compile
needs. The cases and tolerances (bf16: one ulp) are in tests/support/kernel_cases.py, shared with the
CUDA tests in tests/gpu.
"""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import (EPS, NORMS, TOL, check_bias_gelu, check_mixed_bias_gelu, check_mixed_norm, check_norm,
                          check_rope, check_swiglu, gelu_args, grads_of, norm_args, qkv_slice, rand, swiglu_args,
                                  tables)
from mshpc.kernels import ops, reference

DTYPES = list(TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kind", list(NORMS))
def test_add_norm_matches_reference(kind, residual, dtype):
    check_norm(kind, residual, dtype)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kind", list(NORMS))
def test_add_norm_gradcheck(kind, residual):
    # small: gradcheck's numerical Jacobian costs a forward per input element
    args = norm_args(kind, torch.float64, residual, grad=True, d=19, rows=3)
    assert torch.autograd.gradcheck(NORMS[kind][0], args)


@pytest.mark.parametrize("kind", list(NORMS))
def test_bf16_branch_into_fp32_stream(kind):
    check_mixed_norm(kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bias_gelu_matches_reference(bias, dtype):
    check_bias_gelu(bias, dtype)


@pytest.mark.parametrize("bias", [False, True])
def test_bias_gelu_gradcheck(bias):
    assert torch.autograd.gradcheck(ops.bias_gelu, gelu_args(torch.float64, bias, grad=True, shape=(3, 19)))


def test_bias_gelu_fp32_bias_on_bf16_input():
    check_mixed_bias_gelu()


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_reference(dtype):
    check_swiglu(dtype)


def test_swiglu_gradcheck():
    assert torch.autograd.gradcheck(ops.swiglu, (swiglu_args(torch.float64, grad=True, shape=(3, 2 * 19)),))


def test_swiglu_on_a_strided_input_and_zero_rows():
    """A transposed view is made contiguous first; an empty batch gives an empty result."""
    x = swiglu_args(torch.float32, shape=(10, 6)).t()  # (6, 10): a non-contiguous view
    torch.testing.assert_close(ops.swiglu(x), reference.swiglu(x), **TOL[torch.float32])
    assert ops.swiglu(torch.empty(0, 8)).shape == (0, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_reference_on_a_strided_view(dtype):
    check_rope(dtype)


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
        (torch.ops.mshpc.swiglu, (swiglu_args(torch.float32, grad=True),)),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args)

    def block(x, r, w, b, qk):
        h, s = ops.add_layer_norm(x, r, w, b, EPS)
        return ops.swiglu(torch.cat((ops.bias_gelu(h, b), s), -1)) + s, ops.rope(qk, cos, sin)

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
    with pytest.raises(RuntimeError, match=r"mshpc::swiglu: x's last dim must be even \(\[gate \| up\]\), got 7"):
        ops.swiglu(rand(3, 7).float())
