import dataclasses
from pathlib import Path

import pytest

from mshpc.config import ModelConfig, load_config
from mshpc.diagnose.mfu import MfuDeclineDetector, achieved_tflops, flops_per_token, mfu, peak_tflops
from mshpc.model.gpt import GPT

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


def test_175b_term_by_term_by_hand():
    # configs/gpt-175b.yaml: l=96, h=12288, s=2048, V=64000, MLP 4h. Per layer and token, forward:
    #   GEMMs     2 * (3h^2 QKV + h^2 out + 2*4h^2 MLP) = 24 h^2 = 24 * 150,994,944 = 3,623,878,656
    #   attention 2 * 2 * s * h (QK^T and AV)            = 4 * 2048 * 12288        =   100,663,296
    #   layer total                                                                = 3,724,541,952
    # 96 layers: 357,556,027,392; logits 2 h V = 2 * 12288 * 64000 = 1,572,864,000
    # forward 359,128,891,392; forward + backward (2x forward) = x3 = 1,077,386,674,176
    m = load_config(REPO / "configs/gpt-175b.yaml").model
    assert flops_per_token(m) == 1_077_386_674_176


def test_1_3b_term_by_term_by_hand():
    # configs/gpt-1.3b.yaml: l=24, h=2048, s=2048, V=50304. Per layer and token, forward:
    #   GEMMs 24 h^2 = 24 * 4,194,304 = 100,663,296; attention 4 s h = 16,777,216; sum 117,440,512
    # 24 layers: 2,818,572,288; logits 2 * 2048 * 50304 = 206,045,184; forward 3,024,617,472
    # x3 = 9,073,852,416
    m = load_config(REPO / "configs/gpt-1.3b.yaml").model
    assert flops_per_token(m) == 9_073_852_416
    # a window of 512 keys: attention 4 * 512 * 2048 = 4,194,304 per layer instead of 16,777,216,
    # so 3 * 24 * (16,777,216 - 4,194,304) = 905,969,664 FLOPs fewer per token
    windowed = dataclasses.replace(m, sliding_window=512)
    assert flops_per_token(m) - flops_per_token(windowed) == 905_969_664


def test_mfu_by_hand_for_1_3b_on_8_h100():
    # 9,073,852,416 FLOPs/token * 400,000 tokens/s / 8 devices = 453.69 TFLOP/s per device;
    # over the H100's dense bf16 peak of 989: MFU 0.45874
    m = load_config(REPO / "configs/gpt-1.3b.yaml").model
    assert achieved_tflops(400_000, m, 8) == pytest.approx(453.6926208)
    assert mfu(400_000, m, 8, peak_tflops("NVIDIA H100 80GB HBM3", "bf16")) == pytest.approx(453.6926208 / 989)


def test_mfu_decline_detector_flags_a_10_percent_drop_once_and_not_noise():
    import numpy as np

    rng = np.random.default_rng(0)
    detector = MfuDeclineDetector(window_steps=20, decline=0.1)
    healthy = [detector.update(s, 100 * rng.lognormal(0, 0.05)) for s in range(1000)]
    assert healthy.count(None) == 1000  # 5% noise, one-step dips: never a decline
    declines = [d for s in range(1000, 1100) if (d := detector.update(s, 85 * rng.lognormal(0, 0.05)))]
    assert len(declines) == 1 and 1000 < declines[0].step <= 1020
    assert declines[0].drop == pytest.approx(0.15, abs=0.04)
    # back to health re-arms it: a second decline is a second event
    for s in range(1100, 1150):
        detector.update(s, 100.0)
    assert any(detector.update(s, 80.0) for s in range(1150, 1200))


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


def test_llama3_8b_by_hand():
    # configs/llama3-8b.yaml: l=32, h=4096, 32 heads of 128, 8 kv heads (kv width 1024),
    # SwiGLU ffn 14336, V=128256, s=8192. F / token = 6 * N + 12 * l * s * h, where N counts the
    # weights every token multiplies by: the blocks' matrices and the lm head (not the embedding,
    # a lookup). Per block:
    #   q, out   2 * 4096 * 4096          =  33,554,432
    #   k, v     2 * 4096 * 1024          =   8,388,608
    #   MLP      3 * 4096 * 14336         = 176,160,768   (gate, up, down)
    #   block                             = 218,103,808;  x 32 = 6,979,321,856
    #   lm head  4096 * 128256            =   525,336,576
    #   N = 7,504,658,432; 6 N = 45,027,950,592
    #   attention 12 * 32 * 8192 * 4096   = 12,884,901,888 (QK^T and AV, 4 s h forward, x3)
    #   F / token                         = 57,912,852,480
    m = load_config(REPO / "configs/llama3-8b.yaml").model
    assert flops_per_token(m) == 57_912_852_480


def test_llama3_70b_by_hand():
    # configs/llama3-70b.yaml: l=80, h=8192, 64 heads of 128, 8 kv heads (kv width 1024),
    # SwiGLU ffn 28672, V=128256, s=8192; the formula of the 8B test. Per block:
    #   q, out 2 * 8192^2 = 134,217,728; k, v 2 * 8192 * 1024 = 16,777,216;
    #   MLP 3 * 8192 * 28672 = 704,643,072; block 855,638,016; x 80 = 68,451,041,280
    #   lm head 8192 * 128256 = 1,050,673,152; N = 69,501,714,432; 6 N = 417,010,286,592
    #   attention 12 * 80 * 8192 * 8192 = 64,424,509,440; F / token = 481,434,796,032
    m = load_config(REPO / "configs/llama3-70b.yaml").model
    assert flops_per_token(m) == 481_434_796_032


def test_swiglu_flops_are_6n_of_the_built_model_plus_attention():
    """The count follows the model mshpc builds: 6 FLOPs per token for every weight of a matrix a
    token multiplies by (the blocks' and the lm head; not the embedding lookup, not the norms),
    plus attention's 12 l s h."""
    m = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, mlp="swiglu", ffn_dim=40,
                    tie_embeddings=False)
    model = GPT(m)
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in n)
    assert matrices == 2 * (4 * 32 * 32 + 3 * 32 * 40) + 64 * 32
    assert flops_per_token(m) == 6 * matrices + 12 * 2 * 16 * 32


def test_an_mfu_decline_is_an_event_at_10_percent_and_a_warning_only_past_the_floor(tmp_path, caplog):
    import torch

    from mshpc.diagnose.collector import build_collector
    from mshpc.events import read_events

    cfg = load_config(REPO / "configs/tiny.yaml", ["diagnose.timers=false", "diagnose.mfu_window_steps=5"])
    collector = build_collector(tmp_path, 0, "h", torch.device("cpu"), 0, None, diagnose=cfg.diagnose,
                                model_cfg=cfg.model, parallel=cfg.parallel)
    rate = achieved_tflops(1.0, cfg.model, cfg.parallel.world_size)  # TFLOP/s of one token/s
    with caplog.at_level("DEBUG", logger="mshpc.diagnose.collector"):
        for step, tokens_per_s in enumerate([1000.0] * 10 + [870.0] * 10 + [1000.0] * 10 + [600.0] * 10, 1):
            assert collector.end_step(step, tokens_per_s) == pytest.approx(tokens_per_s * rate)
    declines = [e["step"] for e in read_events(tmp_path) if e["kind"] == "mfu_decline"]
    assert len(declines) == 2 and 10 < declines[0] <= 15 and 30 < declines[1] <= 35  # both recorded
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith("MFU decline at step 3") and "40% below" in warned[0]
