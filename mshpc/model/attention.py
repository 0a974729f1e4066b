"""Causal self-attention with rotary position embeddings and an optional sliding window."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mshpc.config import ModelConfig
from mshpc.kernels.dispatch import select_kernels

log = logging.getLogger(__name__)


def llama3_scaled(inv_freq: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """Llama 3.1's rope scaling (Meta's release; transformers' `rope_type: llama3`): frequencies
    whose wavelength exceeds rope_original_seq_len / low_freq_factor are divided by rope_factor,
    those under rope_original_seq_len / high_freq_factor kept, the band between blended linearly
    in original_seq_len / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    old = m.rope_original_seq_len
    low, high = m.rope_low_freq_factor, m.rope_high_freq_factor
    scaled = torch.where(wavelen > old / low, inv_freq / m.rope_factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / m.rope_factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def rope_cache(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    scaling: ModelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim // 2), of the rotary angles p * theta^(-2i/d)
    (Su et al. 2021, RoFormer eq. 15), frequencies scaled as `scaling.rope_scaling` says;
    computed in float64 so long positions stay accurate."""
    dims = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)
    inv_freq = theta ** -(dims / head_dim)
    if scaling is not None and scaling.rope_scaling == "llama3":
        inv_freq = llama3_scaled(inv_freq, scaling)
    positions = torch.arange(seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)  # (s, hd/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


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


@functools.cache
def _varlen_attn() -> Callable[..., torch.Tensor] | None:
    """FlashAttention's local window through a public API (torch 2.13 has it; older ones may
    not), or None. Imported on first use, on CUDA only: the module pulls in torch._dynamo
    (~2 s), which a process that only builds or inspects a model (a tool, a test) need not pay."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    # a bare Tensor back unless return_aux is asked for, which we never do
    return cast(Callable[..., torch.Tensor], varlen_attn)


def flash_window_supported(q: torch.Tensor, dropout_p: float) -> tuple[bool, str]:
    """Whether FlashAttention's own sliding window (torch.nn.attention.varlen.varlen_attn with
    window_size) can take q (b, s, nh, hd), and why not: it is CUDA-only, for fp16/bf16, head
    dims up to 256, and has no dropout."""
    if not q.is_cuda:
        return False, "not on CUDA"
    if _varlen_attn() is None:
        return False, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False, f"{q.dtype} (flash takes float16/bfloat16)"
    if dropout_p > 0:
        return False, "dropout > 0 (flash's varlen path has none)"
    if q.shape[-1] > 256:
        return False, f"head dim {q.shape[-1]} > 256"
    return True, "CUDA, half precision, no dropout"


@functools.cache
def _log_window_path(path: str, reason: str) -> None:
    log.info("sliding-window attention: %s (%s)", path, reason)


def flash_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention over q, k, v (b, s, nh, hd) where query i sees keys i - W + 1 .. i, by
    FlashAttention's local window: O(s * W) work, and no (s, s) mask is read."""
    b, s, nh, hd = q.shape
    # each sequence of the batch is one variable-length segment of the packed (b * s) tokens
    cu_seq = torch.arange(0, (b + 1) * s, s, device=q.device, dtype=torch.int32)
    packed = [t.reshape(b * s, nh, hd) for t in (q, k, v)]
    varlen_attn = _varlen_attn()
    assert varlen_attn is not None, "the window kernel is chosen only where varlen_attn imports"
    y = varlen_attn(*packed, cu_seq, cu_seq, s, s, window_size=(window - 1, 0))  # (b * s, nh, hd)
    return y.view(b, s, nh, hd)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: fused qkv projection, RoPE on q and k, SDPA, output
    projection; grouped-query (Ainslie et al. 2023) with fewer kv heads than q heads, each kv
    head read by n_head / n_kv_head consecutive q heads. Inputs no longer than the window take
    SDPA's `is_causal=True` (its flash path); a narrower sliding window takes FlashAttention's
    own window where it can run (CUDA, half precision, no dropout) and otherwise SDPA with a
    boolean mask. A document mask (`document_mask`), when given, replaces both. With a `cache`
    (`KVCache`: decoding) the input continues the cached sequence."""

    # buffers, registered in __init__ (nn.Module's attribute lookup types them Tensor | Module)
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    mask: torch.Tensor | None  # None where the window spans seq_len

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kernels = select_kernels(cfg.fused_kernels)
        self.head_dim = cfg.head_size
        # the heads this module's qkv holds: tensor parallelism sets its rank's counts
        self.n_head, self.n_kv_head = cfg.n_head, cfg.kv_heads
        # No window is a window as wide as the longest input.
        self.window = cfg.seq_len if cfg.sliding_window is None else cfg.sliding_window
        self.dropout = cfg.dropout
        # Rows are [q; k; v] (n_head, n_kv_head, n_kv_head heads) with heads contiguous, so a
        # tensor-parallel shard of each part keeps the layout that forward reads.
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * self.head_dim, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)
        # Qwen3's per-head RMSNorm of q and k (weights over head_dim, shared by the heads)
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if cfg.qk_norm else None
        self.norm_eps = cfg.norm_eps
        self.resid_dropout = nn.Dropout(cfg.dropout)
        cos, sin = rope_cache(cfg.seq_len, self.head_dim, cfg.rope_theta, scaling=cfg)
        # Non-persistent: derived from the config, so checkpoints hold parameters only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        mask = sliding_window_mask(cfg.seq_len, self.window) if self.window < cfg.seq_len else None
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor, doc_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        return self.resid_dropout(self.proj(self.heads(x, doc_mask, cache)))  # (b, s, d)

    def heads(self, x: torch.Tensor, doc_mask: torch.Tensor | None = None,
              cache: KVCache | None = None) -> torch.Tensor:
        """Everything before the output projection: the heads' outputs (b, s, nh * hd), which the
        fused parallel block projects itself, chunk by chunk behind its reduce-scatter."""
        qkv = self.qkv(x)  # (b, s, (nh + 2 * nkv) * hd): s and the width from qkv, which may gather or split them
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, self.head_dim)  # (b, s, nh + 2 * nkv, hd)
        start = 0 if cache is None else cache.length
        cos, sin = self.rope_cos[start:start + s], self.rope_sin[start:start + s]
        if self.q_norm is not None and self.k_norm is not None:  # each normed, then rotated
            # (the norm's backward reads its input whole: a contiguous copy of each part)
            q, k = (self.kernels.rope(self.kernels.add_rms_norm(part.contiguous(), None, w, self.norm_eps)[0], cos, sin)
                    for part, w in ((qkv[:, :, :self.n_head], self.q_norm),
                                    (qkv[:, :, self.n_head:self.n_head + self.n_kv_head], self.k_norm)))
        else:
            # q and k rotated in one call, as (b, s, nh + nkv, hd): a strided view of qkv, no copy
            qk = self.kernels.rope(qkv[:, :, :self.n_head + self.n_kv_head], cos, sin)
            q, k = qk.split((self.n_head, self.n_kv_head), dim=2)  # (b, s, nh, hd), (b, s, nkv, hd)
        # v copied out of qkv: SDPA saves v for backward, and a view would keep the whole qkv
        # output alive with it (q and k are rope's new tensor already): Korthikanti's count
        v = qkv[:, :, self.n_head + self.n_kv_head:].contiguous()
        if cache is None:
            y = self.attend(q, k, v, self.dropout if self.training else 0.0, doc_mask)
        else:
            y = cache.attend(q, k, v, self.window)
        return y.reshape(b, s, -1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
               doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of q (b, s, nh, hd) over k, v (b, s, nkv, hd), within the window and,
        when `doc_mask` (b, 1, s, s) is given, within each document; returns (b, s, nh, hd). Its
        own method so that selective activation checkpointing can recompute just this part."""
        s = q.shape[1]
        if s > self.window and doc_mask is None:
            flash, reason = flash_window_supported(q, dropout_p)
            _log_window_path("FlashAttention window" if flash else "SDPA with a boolean mask", reason)
            if flash:
                return flash_window_attention(q, *expand_kv(k, v, q.shape[2], dim=2), self.window)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, hd), as SDPA takes them
        # SDPA's own grouped-query path: no expanded copy of k and v, and on CPU at the tiny and
        # 125M shapes 0.6-1.0x the time of repeat_interleave first (benchmarks/gqa_attention.py)
        gqa = k.shape[1] != q.shape[1]
        if doc_mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=doc_mask, dropout_p=dropout_p, enable_gqa=gqa)
        elif s <= self.window:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
        else:
            assert self.mask is not None  # window < s <= seq_len, so __init__ built it
            # The window mask depends only on (i, j), so a shorter input uses its top-left corner.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:s, :s], dropout_p=dropout_p,
                                               enable_gqa=gqa)
        return y.transpose(1, 2)


def expand_kv(k: torch.Tensor, v: torch.Tensor, n_head: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with each kv head repeated for the n_head / n_kv_head q heads that read it (along
    the heads' `dim`), for kernels without a grouped-query mode; unchanged when the counts agree."""
    groups = n_head // k.shape[dim]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=dim), v.repeat_interleave(groups, dim=dim)


class KVCache:
    """One layer's keys and values of the positions decoded so far, for incremental decoding:
    each forward appends its new (rotated) keys and values and attends over what is kept. With a
    sliding window only the last W keys can be seen again, so no more are kept."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (b, kept, nkv, hd)
        self.v: torch.Tensor | None = None
        self.length = 0  # positions consumed: the absolute position of the next token

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        """Attention of the new queries q (b, s, nh, hd) at positions length.. over the kept keys
        and the new k, v (b, s, nkv, hd); returns (b, s, nh, hd) and keeps the last W keys."""
        s = q.shape[1]
        keys = k if self.k is None else torch.cat((self.k, k), dim=1)
        values = v if self.v is None else torch.cat((self.v, v), dim=1)
        # positions of the queries and of the kept keys (the last keys.shape[1] ones)
        end = self.length + s
        qpos = torch.arange(self.length, end, device=q.device)[:, None]
        kpos = torch.arange(end - keys.shape[1], end, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window)  # (s, kept): sliding_window_mask's rule
        qt, kt, vt = (t.transpose(1, 2) for t in (q, keys, values))
        y = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=kt.shape[1] != qt.shape[1])
        self.k, self.v, self.length = keys[:, -window:], values[:, -window:], end
        return y.transpose(1, 2)
