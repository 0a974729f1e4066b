"""A GPT decoder: token embedding, pre-norm blocks (serial or parallel), final norm, lm head.

Plain PyTorch modules that know nothing of parallelism; `parallel/` applies that from outside.
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mshpc.config import ModelConfig
from mshpc.errors import ConfigError
from mshpc.kernels.dispatch import REFERENCE, Kernels, select_kernels
from mshpc.model.attention import CausalSelfAttention, KVCache, document_mask
from mshpc.model.moe import GroupedExperts, MoE
from mshpc.model.router import Router


class RMSNorm(nn.Module):
    """Root-mean-square norm, x / sqrt(mean(x^2) + eps) * g (Zhang & Sennrich 2019, eq. 4),
    computed in at least fp32. forward(x, residual) adds the residual first, in the same kernel
    when the kernels are fused, and returns (normed, x + residual)."""

    def __init__(self, dim: int, eps: float = 1e-5, kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (Ba et al. 2016), computed in at least fp32; forward as
    RMSNorm's: (normed, x + residual)."""

    def __init__(self, dim: int, eps: float = 1e-5, kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.add_layer_norm(x, residual, self.weight, self.bias, self.eps)


def build_norm(cfg: ModelConfig) -> RMSNorm | LayerNorm:
    """The norm named by `cfg.norm` over d_model features."""
    kernels = select_kernels(cfg.fused_kernels)
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps, kernels=kernels)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.d_model, eps=cfg.norm_eps, kernels=kernels)
    raise ConfigError(f"model.norm={cfg.norm!r} is not a norm (choose 'rmsnorm' or 'layernorm')")


class MLP(nn.Module):
    """d -> ffn -> d feed-forward, ffn = model.ffn_width. gelu: GeLU in GPT-2's tanh
    approximation; biases only with model.mlp_bias, the first a parameter of its own added inside
    the GeLU kernel (Megatron's skip_bias_add with its bias-GeLU fusion), so that fc stays a plain
    GEMM. swiglu (Shazeer 2020; Llama): fc holds the gate and up rows [gate; up] as one GEMM of
    2 * ffn outputs, the fused gate computes silu(gate) * up, and proj is the down projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kernels = select_kernels(cfg.fused_kernels)
        self.gated = cfg.mlp == "swiglu"
        ffn = cfg.ffn_width
        self.fc = nn.Linear(cfg.d_model, (2 if self.gated else 1) * ffn, bias=False)
        self.fc_bias = nn.Parameter(torch.zeros(ffn)) if cfg.mlp_bias else None
        self.proj = nn.Linear(ffn, cfg.d_model, bias=cfg.mlp_bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.hidden(x)))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activation's output (b, s, ffn), the down projection's input: the fused parallel
        block projects it itself, chunk by chunk behind its reduce-scatter."""
        h = self.fc(x)  # (b, s, 2 * ffn) [gate | up] for swiglu, else (b, s, ffn)
        return self.kernels.swiglu(h) if self.gated else self.kernels.bias_gelu(h, self.fc_bias)


def build_moe(cfg: ModelConfig) -> MoE:
    """A mixture of experts for a layer of `cfg`, its shared experts (if any) one SwiGLU MLP."""
    shared = None
    if cfg.shared_ffn:
        shared = MLP(dataclasses.replace(cfg, mlp="swiglu", ffn_dim=cfg.shared_ffn, mlp_bias=False, dropout=0.0))
    return MoE(cfg, shared)


class Block(nn.Module):
    """Pre-norm transformer block. Serial: x + attn(ln_1(x)), then + mlp(ln_2(.)), the middle
    residual add fused into ln_2. Parallel (PaLM, Chowdhery et al. 2022 sec. 2; MegaScale sec.
    3.1): x + attn(ln_1(x)) + mlp(ln_1(x)), one norm and no ln_2. In a mixture-of-experts
    layer (`moe`: model.is_moe_layer) `mlp` is the MoE."""

    def __init__(self, cfg: ModelConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln_1 = build_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = None if cfg.parallel_block else build_norm(cfg)
        self.mlp: MLP | MoE = build_moe(cfg) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor, doc_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        if self.ln_2 is not None:
            h, x = self.attention_half(x, doc_mask, cache)
            return x + self.mlp(h)
        h, _ = self.ln_1(x)  # (b, s, d)
        kind = h.device.type
        if torch.is_autocast_enabled(kind):  # one cast copy for both branches' GEMMs to save, not one each
            h = h.to(torch.get_autocast_dtype(kind))
        return x + self.attn(h, doc_mask, cache) + self.mlp(h)  # both branches read the same normed input

    def attention_half(self, x: torch.Tensor, doc_mask: torch.Tensor | None = None,
                       cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A serial block's first half: (ln_2 of the residual stream, the stream x + attn(ln_1(x))),
        the add and its norm in one pass. Expert parallelism's overlapped block runs it per slice
        of the micro-batch (parallel/expert_dispatch.py); train.compile compiles only it in a MoE
        block (parallel/compile_blocks.py)."""
        assert self.ln_2 is not None
        h, _ = self.ln_1(x)  # (b, s, d)
        return self.ln_2(self.attn(h, doc_mask, cache), residual=x)


class GPT(nn.Module):
    """Decoder-only language model; positions come from RoPE inside attention, so there is no
    learned position table. forward maps token ids (b, s) to fp32 logits (b, s, vocab); with
    `segments` (b, s), the document number of each position, attention stays in each document.

    A pipeline stage is a GPT with the parts it does not own set to None and layers deleted
    (torchtitan's split): `layers` is keyed by the layer's index, so every parameter keeps its
    full-model name; a stage without the embedding takes hidden states (b, s, d), one without
    the head returns them."""

    # None on a pipeline stage that does not own the part
    tok_embeddings: nn.Embedding | None
    norm: RMSNorm | LayerNorm | None
    lm_head: nn.Linear | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg, cfg.is_moe_layer(i)) for i in range(cfg.n_layer)})
        self.norm = build_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw weights from N(0, init_std), set norms to 1 and biases to 0; residual output
        projections get std / sqrt(2 * n_layer), GPT-2's scaling (Radford et al. 2019, sec. 2.3)."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layer)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, GroupedExperts):
                nn.init.normal_(module.fc, mean=0.0, std=std)
                nn.init.normal_(module.proj, mean=0.0, std=residual_std)
            elif isinstance(module, (RMSNorm, LayerNorm)):
                nn.init.ones_(module.weight)
            elif isinstance(module, Router):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            for name, p in module.named_parameters(recurse=False):
                if name.endswith("bias") and p is not None:  # norm, linear and fc_bias
                    nn.init.zeros_(p)
        for layer in self.layers.values():
            assert isinstance(layer, Block)  # layers holds nothing else
            mlp = layer.mlp.shared if isinstance(layer.mlp, MoE) else layer.mlp
            for proj in (layer.attn.proj, *([] if mlp is None else [cast(MLP, mlp).proj])):
                nn.init.normal_(proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: torch.Tensor, segments: torch.Tensor | None = None,
                caches: list[KVCache] | None = None) -> torch.Tensor:
        """`caches`, one per layer (decoding): idx continues the sequence they hold, and they
        take its keys and values; without, idx is a whole sequence."""
        start = 0 if caches is None else caches[0].length
        if start + idx.shape[1] > self.cfg.seq_len:
            raise ConfigError(
                f"input of {start + idx.shape[1]} tokens exceeds model.seq_len={self.cfg.seq_len}"
            )
        # One mask for every layer: built once per micro-batch, not once per layer.
        mask = None if segments is None else document_mask(segments, self.cfg.sliding_window)
        x = self.dropout(self.tok_embeddings(idx)) if self.tok_embeddings is not None else idx  # (b, s, d)
        for i, layer in enumerate(self.layers.values()):
            x = layer(x, mask) if caches is None else layer(x, mask, caches[i])
        if self.lm_head is None:
            return x
        assert self.norm is not None  # a stage with the head has the final norm too
        h, _ = self.norm(x)
        return self.lm_head(h).float()  # (b, s, vocab)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters counted once each (a tied weight once). exclude_embeddings leaves out the
        token embedding and an untied lm head: Kaplan et al. 2020's non-embedding N."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            assert self.tok_embeddings is not None and self.lm_head is not None, "a whole model's count"
            n -= self.tok_embeddings.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (b, s, vocab) against targets (b, s), in fp32;
    targets of -100 are ignored."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
