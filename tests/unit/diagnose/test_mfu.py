import dataclasses
from pathlib import Path

import pytest

from mshpc.config import load_config
from mshpc.diagnose.mfu import flops_per_token, mfu, peak_tflops

REPO = Path(__file__).resolve().parents[3]


def narayanan(l, h, s, v):
    """Narayanan et al. 2021 Sec. 5.1 without recomputation, per token: 72 l h^2 (1 + s/6h + V/12lh)."""
    return 72 * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))


def test_175b_matches_narayanan_and_hand_value():
    m = load_config(REPO / "configs/gpt-175b.yaml").model
    assert flops_per_token(m) == pytest.approx(narayanan(96, 12288, 2048, 64000), rel=1e-12)
    # by hand: 72*96*12288^2 = 1.04368e12; x (1 + 1/36 + 64000/14155776) = 1.03230
    assert flops_per_token(m) == pytest.approx(1.07739e12, rel=1e-4)


def test_1_3b_matches_narayanan_and_hand_value():
    m = load_config(REPO / "configs/gpt-1.3b.yaml").model
    assert flops_per_token(m) == pytest.approx(narayanan(24, 2048, 2048, 50304), rel=1e-12)
    # by hand: 72*24*2048^2 = 7.2478e9; x (1 + 1/6 + 50304/589824) = 1.25195
    assert flops_per_token(m) == pytest.approx(9.0739e9, rel=1e-4)


def test_sliding_window_reduces_only_the_attention_term():
    m = load_config(REPO / "configs/gpt-1.3b.yaml").model
    windowed = dataclasses.replace(m, sliding_window=512)
    assert flops_per_token(windowed) == pytest.approx(narayanan(24, 2048, 512, 50304), rel=1e-12)
    assert flops_per_token(dataclasses.replace(m, sliding_window=4096)) == flops_per_token(m)


def test_peak_table_and_mfu():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("cpu", "fp32") is None
    m = load_config(REPO / "configs/gpt-1.3b.yaml").model
    tokens_per_s = 0.5 * 989e12 * 8 / flops_per_token(m)
    assert mfu(tokens_per_s, m, n_devices=8, peak=989.0) == pytest.approx(0.5)
    assert mfu(tokens_per_s, m, n_devices=8, peak=None) is None
