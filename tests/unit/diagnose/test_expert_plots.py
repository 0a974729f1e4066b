"""The diagnose report's expert-load picture and line, from a run's metrics rows."""

from __future__ import annotations

import numpy as np

from mshpc.diagnose.expert_plots import expert_layers, expert_load, expert_summary, load_matrix


def rows(steps: int = 5) -> list[dict]:
    out = []
    for s in range(1, steps + 1):
        skewed = [40 + 10 * s, 20, 20, 20 - 2 * s]  # layer 2 drifts toward expert 0
        out.append({"step": s, "loss": 3.0, "moe_load_max_mean": max(skewed) / 25, "moe_dropped": 0,
                    "moe_aux_loss": 1.1, "moe_z_loss": 0.5, "moe_load_max_mean/layer0": 1.0,
                    "moe_load_max_mean/layer2": max(skewed) / 25,
                    "moe_tokens_per_expert/layer0": [25, 25, 25, 25], "moe_tokens_per_expert/layer2": skewed})
    return out


def test_the_picture_has_a_band_per_layer(tmp_path):
    metrics = rows()
    assert expert_layers(metrics) == [0, 2] and expert_layers([{"step": 1, "loss": 1.0}]) == []
    steps, load = load_matrix(metrics, 2)
    assert steps == [1, 2, 3, 4, 5] and load.shape == (4, 5)
    np.testing.assert_allclose(load.mean(axis=0), 1.0)  # each step's load over its mean
    path = expert_load(metrics, tmp_path / "experts.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_summary_names_the_worst_layer():
    line = expert_summary(rows())
    assert line is not None and line.startswith("experts: max/mean load 3.60 at step 5 (worst: layer 2)")
    assert expert_summary([{"step": 1, "loss": 1.0}]) is None
