"""Grouped-query attention through the real CLI: a multi-query model (1 kv head: each tp rank
keeps a copy of it) saved at tp=2 x pp=2 resumes bitwise at that layout, and resumes at tp=1 x
pp=1 (dp=2), the kv rows joined from the first copy. That it trains like the unsplit model, with
1 kv head and with 2 (split over tp), is tests/dist/parallel/test_tensor_parallel.py's (its gqa
and mqa cases); resharding 2 kv heads, tests/unit/checkpoint/test_relayout.py's."""

import numpy as np
import pytest

from support.ckpt_runs import MQA, MQA_TP2_PP2, final_params, losses, run

QKV = "layers.0.attn.qkv.weight"


def resume(tmp_path, corpus_cache, straight, *overrides, nproc):
    out = run(tmp_path, corpus_cache, "resumed", *overrides, f"train.resume={straight / 'checkpoints' / 'step-0000004'}",
              nproc=nproc)
    assert "resumed from step 4" in out.stderr
    return losses(tmp_path, "resumed"), final_params(tmp_path / "resumed" / "checkpoints")


def test_mqa_tp2_pp2_checkpoint_resumes_bitwise(mqa_tp2_pp2, tmp_path, corpus_cache):
    got_losses, got = resume(tmp_path, corpus_cache, mqa_tp2_pp2, *MQA_TP2_PP2, nproc=4)
    assert got_losses == losses(mqa_tp2_pp2.parent, mqa_tp2_pp2.name)[4:]
    want = final_params(mqa_tp2_pp2 / "checkpoints")
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    # each tp rank saved its part with its copy of the kv head (k and v rows after its 2 q
    # heads), and the copies agree bitwise: their gradients were summed over both ranks
    kv0, kv1 = (want[f"{QKV}@tp{r}"][2 * 16:] for r in (0, 1))
    assert kv0.shape == (2 * 16, 64) and np.array_equal(kv0, kv1)


def test_mqa_tp2_pp2_checkpoint_resumes_at_tp1_pp1(mqa_tp2_pp2, tmp_path, corpus_cache):
    got_losses, got = resume(tmp_path, corpus_cache, mqa_tp2_pp2, *MQA, nproc=2)  # dp=2
    assert got_losses == pytest.approx(losses(mqa_tp2_pp2.parent, mqa_tp2_pp2.name)[4:], rel=1e-5)
    want = final_params(mqa_tp2_pp2 / "checkpoints")
    assert got[QKV].shape == ((4 + 2) * 16, 64)
    # the whole qkv against the tp=2 run's parts: q heads in rank order, then the kv head once.
    # Tolerance as test_resume_tp.py's, but atol 1e-4: Adam turns a last-bit gradient difference
    # into a full step on a near-zero moment (measured: one element of 16384 off by 2.3e-5); a
    # misplaced head would be off by the weights' own size (~1e-2)
    joined = np.concatenate([want[f"{QKV}@tp0"][:32], want[f"{QKV}@tp1"][:32], want[f"{QKV}@tp0"][32:]])
    np.testing.assert_allclose(got[QKV], joined, rtol=1e-4, atol=1e-4)
