"""Grouped-query attention through the real CLI at tp=2 with 1 kv head (multi-query: each tp rank
keeps a copy of it): its step-4 checkpoint resumes bitwise at tp=2, and resumes at tp=1 (the kv
rows joined from the first copy). That it trains like the unsplit model, with 1 kv head and with
2 (split over tp), is tests/dist/parallel/test_tensor_parallel.py's (its gqa and mqa cases)."""

import numpy as np
import pytest

from support.ckpt_runs import final_params, losses, run

MQA = ["model.n_head=4", "model.n_kv_head=1"]
TP2 = [*MQA, "parallel.tp=2", "train.micro_batch=16"]  # dp=1, a global batch of 16 as at dp=2
QKV = "layers.0.attn.qkv.weight"


@pytest.fixture(scope="module")
def mqa_tp2(tmp_path_factory, corpus_cache):
    tmp = tmp_path_factory.mktemp("mqa")
    run(tmp, corpus_cache, "tp2", *TP2)
    return tmp / "tp2"


def resume(tmp_path, corpus_cache, straight, *overrides):
    out = run(tmp_path, corpus_cache, "resumed", *overrides, f"train.resume={straight / 'checkpoints' / 'step-0000004'}")
    assert "resumed from step 4" in out.stderr
    return losses(tmp_path, "resumed"), final_params(tmp_path / "resumed" / "checkpoints")


def test_mqa_tp2_checkpoint_resumes_bitwise(mqa_tp2, tmp_path, corpus_cache):
    got_losses, got = resume(tmp_path, corpus_cache, mqa_tp2, *TP2)
    assert got_losses == losses(mqa_tp2.parent, "tp2")[4:]
    want = final_params(mqa_tp2 / "checkpoints")
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    # each tp rank saved its part with its copy of the kv head (k and v rows after its 2 q
    # heads), and the copies agree bitwise: their gradients were summed over both ranks
    kv0, kv1 = (want[f"{QKV}@tp{r}"][2 * 16:] for r in (0, 1))
    assert kv0.shape == (2 * 16, 64) and np.array_equal(kv0, kv1)


def test_mqa_tp2_checkpoint_resumes_at_tp1(mqa_tp2, tmp_path, corpus_cache):
    got_losses, got = resume(tmp_path, corpus_cache, mqa_tp2, *MQA)  # dp=2, tp=1
    assert got_losses == pytest.approx(losses(mqa_tp2.parent, "tp2")[4:], rel=1e-5)
    want = final_params(mqa_tp2 / "checkpoints")
    assert got[QKV].shape == ((4 + 2) * 16, 64)
    # the whole qkv against the tp=2 run's parts: q heads in rank order, then the kv head once.
    # Tolerance as test_resume_tp.py's, but atol 1e-4: Adam turns a last-bit gradient difference
    # into a full step on a near-zero moment (measured: one element of 16384 off by 2.3e-5); a
    # misplaced head would be off by the weights' own size (~1e-2)
    joined = np.concatenate([want[f"{QKV}@tp0"][:32], want[f"{QKV}@tp1"][:32], want[f"{QKV}@tp0"][32:]])
    np.testing.assert_allclose(got[QKV], joined, rtol=1e-4, atol=1e-4)
