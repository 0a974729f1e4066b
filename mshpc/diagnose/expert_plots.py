"""The report's picture of a mixture of experts: each MoE layer's load per expert over steps
(tokens routed to an expert over the layer's mean, from metrics.jsonl's
moe_tokens_per_expert/layer<i>), and each layer's max/mean load beneath."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from mshpc.diagnose.plots import DPI, plt

KEY = re.compile(r"moe_tokens_per_expert/layer(\d+)$")


def expert_layers(metrics: list[dict[str, Any]]) -> list[int]:
    """The MoE layers metrics.jsonl has loads of, in order (none for a dense run)."""
    found = {int(m.group(1)) for r in metrics for k in r if (m := KEY.match(k))}
    return sorted(found)


def load_matrix(metrics: list[dict[str, Any]], layer: int) -> tuple[list[int], np.ndarray]:
    """(steps, (experts, steps) load over the layer's mean load at each step)."""
    rows = [r for r in metrics if f"moe_tokens_per_expert/layer{layer}" in r]
    loads = np.array([r[f"moe_tokens_per_expert/layer{layer}"] for r in rows], dtype=float)  # (steps, E)
    mean = np.maximum(loads.mean(axis=1, keepdims=True), 1e-12)
    return [r["step"] for r in rows], (loads / mean).T


def expert_load(metrics: list[dict[str, Any]], path: Path) -> Path:
    """Every MoE layer's experts as rows (a band per layer, layer 0 on top) and the steps as
    columns, coloured by load / mean (1: balanced); below, each layer's max/mean over steps."""
    layers = expert_layers(metrics)
    bands = [load_matrix(metrics, i) for i in layers]
    steps = bands[0][0]
    image = np.concatenate([m for _, m in bands])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    shown = top.imshow(image, aspect="auto", cmap="magma", interpolation="nearest", vmin=0,
                       vmax=max(2.0, float(np.percentile(image, 99))),
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, image.shape[0], 0))
    experts = bands[0][1].shape[0]
    for k in range(1, len(layers)):
        top.axhline(k * experts, color="white", lw=0.6)
    top.set_yticks([(k + 0.5) * experts for k in range(len(layers))], [f"layer {i}" for i in layers], fontsize=7)
    top.set_title("tokens per expert / the layer's mean (1: balanced)")
    fig.colorbar(shown, ax=top, fraction=0.03)
    for i, (s, m) in zip(layers, bands, strict=True):
        bottom.plot(s, m.max(axis=0), lw=1, label=f"layer {i}")
    bottom.axhline(1.0, color="#999999", lw=0.6)
    bottom.set_ylabel("max / mean load")
    bottom.set_xlabel("step")
    if len(layers) <= 8:
        bottom.legend(fontsize=7, frameon=False, ncol=4)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def expert_summary(metrics: list[dict[str, Any]]) -> str | None:
    """One line for the report's summary: the last step's worst layer, dropped tokens, router losses."""
    rows = [r for r in metrics if "moe_load_max_mean" in r]
    if not rows:
        return None
    last = rows[-1]
    worst = max(expert_layers(metrics), key=lambda i: last.get(f"moe_load_max_mean/layer{i}", 0.0))
    return (f"experts: max/mean load {last['moe_load_max_mean']:.2f} at step {last['step']} (worst: layer {worst}), "
            f"{last['moe_dropped']} token copies dropped, aux loss {last['moe_aux_loss']:.3f}, "
            f"z loss {last['moe_z_loss']:.3f}")
