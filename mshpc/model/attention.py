"""Causal self-attention with rotary position embeddings and an optional sliding window."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mshpc.config import ModelConfig


def rope_cache(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim // 2), of the rotary angles p * theta^(-2i/d)
    (Su et al. 2021, RoFormer eq. 15); computed in float64 so long positions stay accurate."""
    dims = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)
    inv_freq = theta ** -(dims / head_dim)
    positions = torch.arange(seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)  # (s, hd/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., i], x[..., i + hd/2]) of x (b, n_head, s, hd) by its position's
    angle (RoFormer eq. 34 in GPT-NeoX's rotate-half pairing); cos and sin are (s, hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)  # each (b, nh, s, hd/2)
    # Products promote a bf16 x to the fp32 tables; the result goes back to x's dtype.
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


def sliding_window_mask(
    seq_len: int, window: int | None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Boolean (s, s) mask, True where query i may attend key j: max(0, i - W + 1) <= j <= i,
    i.e. W tokens counting itself; window None is the plain causal mask."""
    i = torch.arange(seq_len, device=device).unsqueeze(1)  # (s, 1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)  # (1, s)
    causal = j <= i
    return causal if window is None else causal & (j > i - window)


def document_mask(segments: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean (b, 1, s, s) mask for packed sequences: the rule of `sliding_window_mask`, and
    query i and key j in the same document (segments (b, s) holds each position's document
    number). Positions need no reset at a document's start: RoPE scores depend only on i - j."""
    s = segments.shape[-1]
    same_doc = segments.unsqueeze(-1) == segments.unsqueeze(-2)  # (b, s, s)
    return (same_doc & sliding_window_mask(s, window, segments.device)).unsqueeze(1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: fused qkv projection, RoPE on q and k, SDPA, output
    projection. A sliding window narrower than the input uses a boolean mask; otherwise
    `is_causal=True` keeps SDPA's flash path. A document mask (`document_mask`), when given,
    replaces both."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        # No window is a window as wide as the longest input.
        self.window = cfg.seq_len if cfg.sliding_window is None else cfg.sliding_window
        self.dropout = cfg.dropout
        # Rows are [q; k; v], each d_model wide with heads contiguous, so a tensor-parallel
        # shard of each third keeps the (3, heads, hd) layout that forward reads.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        cos, sin = rope_cache(cfg.seq_len, self.head_dim, cfg.rope_theta)
        # Non-persistent: derived from the config, so checkpoints hold parameters only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        mask = sliding_window_mask(cfg.seq_len, self.window) if self.window < cfg.seq_len else None
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # (b, s, 3 * d): s and the width from qkv, which may gather or split them
        b, s = qkv.shape[:2]
        # -1 heads: the local head count, which tensor parallelism divides.
        q, k, v = qkv.view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)  # each (b, nh, s, hd)
        y = self.attend(q, k, v, doc_mask).transpose(1, 2).reshape(b, s, -1)  # (b, s, d)
        return self.resid_dropout(self.proj(y))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The attention core, RoPE and softmax(q k^T) v on (b, nh, s, hd), within each document
        when `doc_mask` (b, 1, s, s) is given: its own method so that selective activation
        checkpointing can recompute just this part."""
        s = q.shape[2]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dropout_p = self.dropout if self.training else 0.0
        if doc_mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=doc_mask, dropout_p=dropout_p)
        if s <= self.window:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        # The window mask depends only on (i, j), so a shorter input uses its top-left corner.
        mask = self.mask[:s, :s]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
