"""The fused permute and unpermute of a mixture of experts (csrc/cpu/moe_permute.cpp) against
their pure-torch references on CPU: forward, gradients (gradcheck in float64), dropped copies,
empty inputs. The cases are tests/support/kernel_cases.py's, shared with the CUDA tests."""

from __future__ import annotations

import pytest
import torch
from support.kernel_cases import TOL, check_moe_permute, moe_args

from mshpc.kernels import ops, reference

DTYPES = list(TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_and_unpermute_match_reference(dtype):
    check_moe_permute(dtype)
    check_moe_permute(dtype, drop=0, k=1)  # top-1 dropless: a plain permutation


def test_permute_gradcheck():
    x, pos, _, rows = moe_args(torch.float64, grad=True, tokens=5, k=2, d=7, drop=2)
    assert torch.autograd.gradcheck(lambda t: ops.moe_permute(t, pos, rows), (x,))


def test_unpermute_gradcheck():
    x, pos, w, rows = moe_args(torch.float64, grad=True, tokens=5, k=2, d=7, drop=2)
    y = torch.randn(rows, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.moe_unpermute(a, pos, b), (y, w))


def test_a_token_with_every_copy_dropped_comes_back_as_zeros():
    x = torch.randn(3, 8)
    pos = torch.tensor([[0, -1], [-1, -1], [1, 2]])
    w = torch.ones(3, 2)
    out = ops.moe_unpermute(ops.moe_permute(x, pos, 3), pos, w)
    assert torch.equal(out[1], torch.zeros(8))
    torch.testing.assert_close(out, reference.moe_unpermute(reference.moe_permute(x, pos, 3), pos, w))
    dx = torch.autograd.grad(ops.moe_permute(x.requires_grad_(), pos, 3).sum(), x)[0]
    assert torch.equal(dx[1], torch.zeros(8)) and torch.equal(dx[2], torch.full((8,), 2.0))


def test_no_tokens():
    pos = torch.empty(0, 2, dtype=torch.long)
    assert ops.moe_permute(torch.empty(0, 4), pos, 0).shape == (0, 4)
    assert ops.moe_unpermute(torch.empty(0, 4), pos, torch.empty(0, 2)).shape == (0, 4)
