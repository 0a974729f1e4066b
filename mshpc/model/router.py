"""The router of a mixture of experts: which k experts each token goes to, with what weights,
where in expert order each of its copies sits (and which the capacity drops), and the router's
auxiliary losses. Computed in fp32 whatever the autocast dtype (Megatron's and DeepSeek's
practice: the softmax and top-k decide the experts, and bf16 ties flip them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mshpc.config import MoEConfig
from mshpc.kernels.reference import compute_dtype


@dataclass(frozen=True)
class Routing:
    """One micro-batch's routing on this rank, for `tokens` = T tokens."""

    scores: torch.Tensor  # (T, E) fp32: softmax probabilities, or sigmoid scores
    logits: torch.Tensor  # (T, E) fp32: the router's logits (the z-loss reads them)
    experts: torch.Tensor  # (T, k) int64: each token's experts, best first
    weights: torch.Tensor  # (T, k) fp32 (fp64 in a float64 model): their weights in the combination
    pos: torch.Tensor  # (T, k) int64: each copy's row in expert order, -1 where dropped
    routed: torch.Tensor  # (E,) int64: tokens routed to each expert, before the capacity
    counts: torch.Tensor  # (E,) int64: tokens each expert computes (routed, less the dropped)
    rows: int  # kept copies: the rows of the tokens in expert order

    @property
    def dropped(self) -> torch.Tensor:
        return self.routed.sum() - self.counts.sum()


class Router(nn.Module):
    """Scores each token against every expert: `weight` (E, d) maps a token to E logits.
    softmax_topk: the k largest softmax probabilities, renormalised to sum to 1 with
    norm_topk_prob (Mixtral, Qwen). sigmoid_bias: sigmoid scores; the experts are the top k of
    score + `expert_bias` (a buffer, not a parameter: mshpc/parallel/expert_load.py moves it
    toward balance after each step), the weights the scores themselves, renormalised likewise
    (DeepSeek-V3 sec. 2.1.2)."""

    def __init__(self, d_model: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_experts, d_model))
        self.expert_bias: torch.Tensor | None
        if moe.router == "sigmoid_bias":
            self.register_buffer("expert_bias", torch.zeros(moe.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        """Route tokens x (T, d)."""
        dtype = compute_dtype(x.dtype)  # fp32, or fp64 for a float64 model
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.weight.to(dtype))  # (T, E)
        k = self.moe.top_k
        if self.expert_bias is None:
            scores = logits.softmax(dim=-1)
            weights, experts = scores.topk(k, dim=-1)
        else:
            scores = logits.sigmoid()
            experts = (scores.detach() + self.expert_bias).topk(k, dim=-1).indices  # the bias picks, never weighs
            weights = scores.gather(1, experts)
        if self.moe.norm_topk_prob and k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        pos, routed, counts, rows = expert_positions(experts, weights.detach(), self.moe.n_experts,
                                                     capacity(x.shape[0], self.moe))
        return Routing(scores, logits, experts, weights, pos, routed, counts, rows)


def capacity(tokens: int, moe: MoEConfig) -> int | None:
    """Tokens each expert takes from a micro-batch of `tokens` on this rank:
    ceil(capacity_factor * tokens * top_k / n_experts) (Megatron-Core's moe_expert_capacity_factor;
    Fedus et al. 2022 eq. 3); None when dropless."""
    if moe.capacity_factor is None:
        return None
    return math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.n_experts)


def expert_positions(experts: torch.Tensor, weights: torch.Tensor, n_experts: int,
                     cap: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Where each copy (t, j) of a token goes in expert order: (pos (T, k), routed (E,), counts
    (E,), rows). Dropless: every copy, each expert's in token order. With a capacity `cap`, an
    expert keeps its `cap` highest-weighted copies (Megatron's "probs" drop policy) and the rest
    get -1; the kept are numbered 0..rows-1 in expert order."""
    flat = experts.flatten()  # (N,) N = T * k
    n = flat.numel()
    routed = flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))  # a fixed shape, unlike bincount
    if cap is None:
        order = torch.argsort(flat, stable=True)  # expert-major, token order within an expert
        pos = torch.empty_like(flat)
        pos[order] = torch.arange(n, device=flat.device)
        return pos.view_as(experts), routed, routed, n
    by_weight = torch.argsort(weights.flatten(), descending=True, stable=True)
    order = by_weight[torch.argsort(flat[by_weight], stable=True)]  # expert-major, heaviest first
    starts = torch.cumsum(routed, 0) - routed
    rank_in_expert = torch.arange(n, device=flat.device) - starts[flat[order]]
    keep = rank_in_expert < cap
    counts = routed.clamp(max=cap)
    rows = int(counts.sum())  # a host sync: the permuted tensor's size
    pos = torch.full_like(flat, -1)
    pos[order[keep]] = torch.arange(rows, device=flat.device)
    return pos.view_as(experts), routed, counts, rows


def aux_loss(scores: torch.Tensor, routed: torch.Tensor, total_tokens: int, moe: MoEConfig) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2022 eq. 4), as Megatron-Core's
    switch_load_balancing_loss_func: E * sum_i f_i * P_i with f_i the share of the T * k copies
    routed to expert i and P_i the mean router probability of expert i; 1 at perfect balance.
    `routed` and `total_tokens` may count other ranks' tokens too (sequence shards under tp),
    `scores` this rank's only: the sum of every shard's loss is then the loss of all tokens."""
    probs = scores if moe.router == "softmax_topk" else scores / scores.sum(dim=-1, keepdim=True)
    per_expert = probs.sum(dim=0)  # (E,)
    scale = moe.n_experts / (moe.top_k * total_tokens * total_tokens)
    return (per_expert * routed.to(per_expert.dtype)).sum() * scale


def z_loss(logits: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022 eq. 5): the mean over tokens of
    logsumexp(logits)^2, here this rank's sum over the `total_tokens` of every shard."""
    return torch.logsumexp(logits, dim=-1).square().sum() / total_tokens
