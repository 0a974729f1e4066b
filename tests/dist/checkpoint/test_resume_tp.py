"""Tensor parallelism through the real CLI: tp=2 and dp=2 x tp=2 train like dp=2 on the same
global batch, a tp=2 run killed with -9 resumes bitwise (tp shards saved per tp rank), and a
checkpoint resumes at the other tp (joined and re-cut: equal within fp tolerance, since the
order of the sums changes with the layout)."""

import json

import numpy as np
import pytest

from support.ckpt_runs import final_params, kill_and_resume, losses, run

TP2 = ["parallel.tp=2", "train.micro_batch=16"]  # dp=1: the straight run's global batch of 16


@pytest.fixture(scope="module")
def tp_straight(tmp_path_factory, corpus_cache):
    tmp = tmp_path_factory.mktemp("tp")
    run(tmp, corpus_cache, "tp", *TP2)
    return tmp


def test_tp2_trains_like_dp2(straight, tp_straight):
    assert losses(tp_straight, "tp") == pytest.approx(losses(straight, "straight"), rel=1e-5)


def test_dp2_tp2_trains_like_dp2(straight, tmp_path, corpus_cache):
    # 4 ranks; the tp pair of each dp rank reads that dp rank's batch
    run(tmp_path, corpus_cache, "dp2tp2", "parallel.tp=2", "checkpoint.interval_steps=0", nproc=4)
    assert losses(tmp_path, "dp2tp2") == pytest.approx(losses(straight, "straight"), rel=1e-5)


def test_tp2_killed_and_resumed_run_is_bitwise_identical(tp_straight, tmp_path, corpus_cache):
    want = kill_and_resume(tmp_path, corpus_cache, "tp-b", TP2, tp_straight / "tp")
    # each tp rank's shard under its own name; the norms (whole on both) once
    assert {"layers.0.attn.qkv.weight@tp0", "layers.0.attn.qkv.weight@tp1", "norm.weight"} <= set(want)


def _assert_close(got, want):
    # Adam turns a gradient's last-bit difference into a full-size step on a near-zero
    # moment, so a few weights differ by ~1e-6 after 4 steps (on the corpus with its validation
    # split held out, one element of 12288 by 1.07e-5: atol 1e-4, as test_resume_gqa.py's); a
    # misplaced slice would be off by the weights' own size (~1e-2)
    assert got.keys() == want.keys() and len(want) > 0
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_tp2_checkpoint_resumes_at_tp1_dp2(straight, tp_straight, tmp_path, corpus_cache):
    # the tp=2, dp=1 shards joined into whole weights, then cut 1/2 per dp rank: the straight layout
    step4 = tp_straight / "tp" / "checkpoints" / "step-0000004"
    out = run(tmp_path, corpus_cache, "dp2", f"train.resume={step4}")
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, "dp2") == pytest.approx(losses(straight, "straight")[4:], rel=1e-5)
    _assert_close(final_params(tmp_path / "dp2" / "checkpoints"), final_params(straight / "straight" / "checkpoints"))


def test_dp2_checkpoint_resumes_at_tp2(straight, tp_straight, tmp_path, corpus_cache):
    # whole weights (tp=1, in 2 dp shards) cut per tp rank: qkv per head block, proj by columns
    step4 = straight / "straight" / "checkpoints" / "step-0000004"
    out = run(tmp_path, corpus_cache, "tp", *TP2, f"train.resume={step4}")
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, "tp") == pytest.approx(losses(tp_straight, "tp")[4:], rel=1e-5)
    _assert_close(final_params(tmp_path / "tp" / "checkpoints"), final_params(tp_straight / "tp" / "checkpoints"))


def test_swiglu_tp2_checkpoint_reshards_to_tp1(tmp_path, corpus_cache):
    """SwiGLU's fc is saved per tp rank as its rows of the gate and of up, with that rule
    ([dim 0, 2 blocks]) in the manifest; at tp=1 the parts join into the whole [gate; up]: the
    resumed run continues the tp=2 run's losses, and its final fc, cut by hand into each tp rank's
    gate and up rows, is the tp=2 run's."""
    # Llama's width at d_model 64 (8/3 d, rounded); 4 steps, saved at 2 and 4: the cheapest resume
    swiglu = ["model.mlp=swiglu", "model.ffn_dim=172", "train.steps=4", "checkpoint.interval_steps=2"]
    run(tmp_path, corpus_cache, "tp", *TP2, *swiglu)
    step2 = tmp_path / "tp" / "checkpoints" / "step-0000002"
    assert json.loads((step2 / "manifest.json").read_text())["extras"]["tp_splits"]["layers.0.mlp.fc.weight"] == [0, 2]
    out = run(tmp_path, corpus_cache, "dp2", *swiglu, f"train.resume={step2}")
    assert "resumed from step 2" in out.stderr
    assert losses(tmp_path, "dp2") == pytest.approx(losses(tmp_path, "tp")[2:], rel=1e-5)
    whole, parts = final_params(tmp_path / "dp2" / "checkpoints"), final_params(tmp_path / "tp" / "checkpoints")
    for layer in range(2):
        gate, up = np.split(whole[f"layers.{layer}.mlp.fc.weight"], 2)  # (172, 64) each
        for r, rows in enumerate((slice(0, 86), slice(86, 172))):
            np.testing.assert_allclose(parts[f"layers.{layer}.mlp.fc.weight@tp{r}"],
                                       np.concatenate([gate[rows], up[rows]]), rtol=1e-4, atol=1e-5)
