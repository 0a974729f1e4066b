"""After each step: every mixture-of-experts layer's load over the whole global batch, the
router biases moved toward balance (router sigmoid_bias), and the step's MoE metrics.

Each layer sums, on each rank, the tokens it routed to each expert and a few statistics
(model/moe.py STATS) over the step's micro-batches; one all-reduce over the world of a
(n_layer, E + 4) table then gives every rank every layer's totals (a pipeline stage contributes
its own layers, zeros elsewhere), so all ranks move their copies of a bias alike (DeepSeek-V3
sec. 2.1.2: b_i += rate * sign(mean load - load_i), over the batch; Megatron-Core does the same
all-reduce in its finalize_model_grads).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mshpc.config import MoEConfig
from mshpc.model.moe import STATS, MoE
from mshpc.parallel import comm


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """This rank's mixture-of-experts layers by layer index (names `layers.<i>.mlp`)."""
    return {int(name.split(".")[1]): m for name, m in model.named_modules() if isinstance(m, MoE)}


class ExpertLoad:
    """Reads and clears the layers' statistics after each step. Collective over the world."""

    def __init__(self, model: nn.Module, moe: MoEConfig, n_layer: int) -> None:
        self.layers = moe_layers(model)
        self.moe = moe
        self.n_layer = n_layer

    @torch.no_grad()
    def after_step(self) -> torch.Tensor:
        """The step's (n_layer, E + len(STATS)) totals over the world (rows of dense layers zero);
        biases moved. Collective over the world."""
        stats = [layer.stats for layer in self.layers.values()]
        device = stats[0].device if stats else torch.device("cpu")
        table = torch.zeros(self.n_layer, self.moe.n_experts + len(STATS), dtype=torch.float64, device=device)
        for i, layer in self.layers.items():
            table[i] = layer.stats
            layer.stats.zero_()
        comm.all_reduce(table)
        if self.moe.router == "sigmoid_bias":
            self._move_biases(table[:, :self.moe.n_experts])
        return table

    def _move_biases(self, load: torch.Tensor) -> None:
        for i, layer in self.layers.items():
            bias = layer.router.expert_bias
            assert bias is not None
            bias += self.moe.bias_update_rate * torch.sign(load[i].mean() - load[i]).to(bias.dtype)


def load_metrics(table: torch.Tensor, moe: MoEConfig, layers: list[int]) -> dict[str, Any]:
    """The step's MoE row: per layer its max/mean load, for the run the worst of them, the
    dropped copies, the mean auxiliary and z losses per layer and micro-batch (before their
    coefficients), and each MoE layer's tokens per expert (a list: a histogram in TensorBoard
    and W&B)."""
    e = moe.n_experts
    rows = table[layers].cpu()
    load = rows[:, :e]
    dropped, aux, z, micro = (rows[:, e + k] for k in range(len(STATS)))
    imbalance = load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-12)
    out: dict[str, Any] = {
        "moe_load_max_mean": float(imbalance.max()),
        "moe_dropped": int(dropped.sum()),
        "moe_dropped_fraction": float(dropped.sum() / load.sum().clamp(min=1)),
        "moe_aux_loss": float((aux / micro.clamp(min=1)).mean()),
        "moe_z_loss": float((z / micro.clamp(min=1)).mean()),
    }
    for i, ratio, row in zip(layers, imbalance, load, strict=True):
        out[f"moe_load_max_mean/layer{i}"] = float(ratio)
        out[f"moe_tokens_per_expert/layer{i}"] = [int(c) for c in row]
    return out
