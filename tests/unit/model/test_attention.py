"""Sliding-window mask, windowed attention and RoPE against hand-written references."""

import math

import pytest
import torch

from mshpc.config import ModelConfig
from mshpc.kernels.reference import rope
from mshpc.model.attention import CausalSelfAttention, document_mask, rope_cache, sliding_window_mask


def naive_allowed(i: int, j: int, window: int | None) -> bool:
    """The documented convention: query i sees keys max(0, i - W + 1)..i, W tokens with itself."""
    return j <= i and (window is None or j >= max(0, i - window + 1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference rope on the (b, n_head, s, hd) layout these tests write."""
    return rope(x.transpose(1, 2), cos, sin).transpose(1, 2)


def naive_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate (x[i], x[i + hd/2]) at position p by p * theta^(-2i/hd), one pair at a time."""
    out = x.clone()
    hd = x.shape[-1]
    for p in range(x.shape[-2]):
        for i in range(hd // 2):
            angle = p * theta ** (-2 * i / hd)
            a, b = x[..., p, i], x[..., p, i + hd // 2]
            out[..., p, i] = a * math.cos(angle) - b * math.sin(angle)
            out[..., p, i + hd // 2] = a * math.sin(angle) + b * math.cos(angle)
    return out


def naive_attention(attn: CausalSelfAttention, x: torch.Tensor, window: int | None, theta: float):
    """Per-query loops over the allowed keys, then the output projection."""
    b, s, d = x.shape
    hd = attn.head_dim
    nh, kv = d // hd, attn.n_kv_head
    q, k, v = (x @ attn.qkv.weight.T).split([d, kv * hd, kv * hd], dim=-1)
    q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))  # (b, heads, s, hd)
    q, k = naive_rope(q, theta), naive_rope(k, theta)
    y = torch.zeros_like(q)
    for bi in range(b):
        for h in range(nh):
            g = h // (nh // kv)  # the kv head q head h reads
            for i in range(s):
                keys = [j for j in range(s) if naive_allowed(i, j, window)]
                scores = torch.stack([q[bi, h, i] @ k[bi, g, j] for j in keys]) / math.sqrt(hd)
                weights = torch.softmax(scores, dim=0)
                y[bi, h, i] = sum(w * v[bi, g, j] for w, j in zip(weights, keys))
    return y.transpose(1, 2).reshape(b, s, d) @ attn.proj.weight.T


@pytest.mark.parametrize("s,window", [(1, 1), (6, 1), (7, 2), (7, 3), (5, 5), (5, 9), (6, None)])
def test_mask_matches_double_loop(s, window):
    expected = torch.tensor([[naive_allowed(i, j, window) for j in range(s)] for i in range(s)])
    got = sliding_window_mask(s, window)
    assert got.dtype == torch.bool and torch.equal(got, expected)
    if window is not None:
        assert (got.sum(dim=1) <= window).all()  # at most W keys per query, itself included


def double_attention(window: int | None, seq_len: int = 8, theta: float = 10000.0, n_head: int = 2,
                     n_kv_head: int | None = None):
    torch.manual_seed(0)
    cfg = ModelConfig(
        seq_len=seq_len, n_head=n_head, d_model=16, sliding_window=window, rope_theta=theta, n_kv_head=n_kv_head
    )
    attn = CausalSelfAttention(cfg).double()
    # Exact float64 tables, so the comparison is limited by float64, not by fp32 angles.
    attn.rope_cos, attn.rope_sin = rope_cache(seq_len, attn.head_dim, theta, dtype=torch.float64)
    return attn


@pytest.mark.parametrize("window,s", [(3, 8), (1, 8), (3, 6), (None, 8)])
def test_attention_matches_naive_reference(window, s):
    attn = double_attention(window, theta=100.0)
    x = torch.randn(2, s, 16, dtype=torch.float64)
    expected = naive_attention(attn, x, window, 100.0)
    torch.testing.assert_close(attn(x), expected, rtol=1e-10, atol=1e-12)


def test_window_at_least_seq_len_equals_no_window():
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    plain = double_attention(None)(x)
    for window in (8, 20):
        attn = double_attention(window)
        assert attn.mask is None  # the is_causal fast path
        torch.testing.assert_close(attn(x), plain, rtol=0, atol=0)


def test_rope_matches_reference_and_is_identity_at_position_zero():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    cos, sin = rope_cache(5, 8, 10000.0, dtype=torch.float64)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated, naive_rope(x, 10000.0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0])


def test_rope_score_depends_only_on_relative_position():
    torch.manual_seed(0)
    s, hd = 12, 8
    q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)
    cos, sin = rope_cache(s, hd, 10000.0, dtype=torch.float64)
    qr = apply_rope(q.expand(1, 1, s, hd), cos, sin)[0, 0]  # q placed at every position
    kr = apply_rope(k.expand(1, 1, s, hd), cos, sin)[0, 0]
    scores = qr @ kr.T  # (s, s): q at i against k at j
    for offset in range(-3, 4):
        diag = torch.diagonal(scores, offset=offset)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(scores[0, 0], scores[1, 0])  # and it does depend on i - j


def test_document_mask_is_the_window_rule_within_each_document():
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    for window in (None, 2):
        got = document_mask(segments, window)
        assert got.shape == (1, 1, 8, 8) and got.dtype == torch.bool
        expected = torch.tensor([[naive_allowed(i, j, window) and segments[0, i] == segments[0, j]
                                  for j in range(8)] for i in range(8)])
        assert torch.equal(got[0, 0], expected)


@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 3])
def test_grouped_query_attention_matches_naive_reference(n_kv_head, window):
    attn = double_attention(window, theta=100.0, n_head=4, n_kv_head=n_kv_head)
    assert attn.qkv.weight.shape == ((4 + 2 * n_kv_head) * 4, 16)  # [q; k; v] with the kv heads' width
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(attn(x), naive_attention(attn, x, window, 100.0), rtol=1e-10, atol=1e-12)


def expanded_twin(attn: CausalSelfAttention, window: int | None) -> CausalSelfAttention:
    """A multi-head module whose k and v heads are `attn`'s, each repeated for the q heads that
    read it: grouped-query attention written out by hand."""
    mha = double_attention(window, theta=100.0, n_head=4)
    hd, kv = attn.head_dim, attn.n_kv_head
    q, k, v = attn.qkv.weight.detach().split([4 * hd, kv * hd, kv * hd])
    k, v = (t.unflatten(0, (kv, hd)).repeat_interleave(4 // kv, dim=0).flatten(0, 1) for t in (k, v))
    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([q, k, v]))
        mha.proj.weight.copy_(attn.proj.weight)
    return mha


@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 3])
def test_grouped_query_attention_equals_expanded_multi_head_with_document_masks(n_kv_head, window):
    attn = double_attention(window, theta=100.0, n_head=4, n_kv_head=n_kv_head)
    mha = expanded_twin(attn, window)
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    for mask in (None, document_mask(segments, window)):
        y = attn(x, mask)
        torch.testing.assert_close(y, mha(x, mask), rtol=1e-10, atol=1e-12)
    # and the gradient reaching the input, through SDPA's grouped-query backward
    (dx,) = torch.autograd.grad(attn(x).square().sum(), x)
    (dx_mha,) = torch.autograd.grad(mha(x).square().sum(), x)
    torch.testing.assert_close(dx, dx_mha, rtol=1e-10, atol=1e-12)
