"""Pure-torch versions of the fused operators: the definition every kernel is tested against,
and what the model runs when the kernels are off or cannot be built.

Each computes in float32 (float64 for float64 inputs) and rounds its result once to the input's
dtype, as the kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) * weight, s) for s = x + residual (x alone when residual is None): RMSNorm
    (Zhang & Sennrich 2019, eq. 4) over the last dim, in the dtype of s."""
    s = x if residual is None else x + residual
    sf = s.to(compute_dtype(s.dtype))
    y = sf * torch.rsqrt(sf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight
    return y.to(s.dtype), s


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(s) * weight + bias, s) for s = x + residual (Ba et al. 2016), in s's dtype."""
    s = x if residual is None else x + residual
    dtype = compute_dtype(s.dtype)
    y = F.layer_norm(s.to(dtype), (s.shape[-1],), weight.to(dtype), None if bias is None else bias.to(dtype), eps)
    return y.to(s.dtype), s


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(x + bias) in GPT-2's tanh form (Hendrycks & Gimpel 2016), in x's dtype."""
    v = x.to(compute_dtype(x.dtype))
    if bias is not None:
        v = v + bias.to(v.dtype)
    return F.gelu(v, approximate="tanh").to(x.dtype)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x (..., 2 * ffn) holding [gate | up] in its last dim (Shazeer 2020,
    eq. 5; Llama's MLP), in x's dtype: (..., ffn)."""
    gate, up = x.to(compute_dtype(x.dtype)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., i], x[..., i + hd/2]) of x (b, s, n_head, hd) by its position's
    angle (RoFormer eq. 34, GPT-NeoX's rotate-half pairing); cos and sin are (>= s, hd/2)."""
    s = x.shape[1]
    cos, sin = cos[:s, None, :], sin[:s, None, :]  # (s, 1, hd/2): broadcast over heads
    x1, x2 = x.to(compute_dtype(x.dtype)).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def _padded_rows(pos: torch.Tensor, rows: int) -> torch.Tensor:
    """pos (tokens, k) with each dropped entry (-1) pointing at an extra row `rows`, flattened."""
    return torch.where(pos < 0, rows, pos).flatten()


def moe_permute(x: torch.Tensor, pos: torch.Tensor, rows: int) -> torch.Tensor:
    """Tokens x (tokens, d) into expert order: row pos[t, j] of the (rows, d) result is x[t], for
    every j the capacity kept (pos >= 0); the kept entries name each row once."""
    k = pos.shape[1]
    kept = pos.flatten() >= 0
    tokens = torch.arange(pos.shape[0], device=pos.device).repeat_interleave(k)[kept]
    source = torch.empty(rows, dtype=torch.long, device=pos.device)
    source[pos.flatten()[kept]] = tokens  # the token each permuted row comes from
    return x.index_select(0, source)


def moe_unpermute(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Expert outputs y (rows, d) back to tokens: out[t] = sum_j w[t, j] * y[pos[t, j]] over the
    kept j (w: the router's weights, (tokens, k)), summed in the compute dtype, in y's dtype."""
    rows, d = y.shape
    acc = compute_dtype(y.dtype)
    padded = torch.cat([y.to(acc), y.new_zeros(1, d, dtype=acc)])  # a dropped entry reads zeros
    picked = padded.index_select(0, _padded_rows(pos, rows)).view(*pos.shape, d)  # (tokens, k, d)
    return (picked * w.to(acc).unsqueeze(-1)).sum(1).to(y.dtype)
