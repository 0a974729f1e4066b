"""Grouped-query attention through the real CLI, with 1 kv head and with 2, saved at tp=2: each
run resumes bitwise at its layout and resumes at tp=1 x pp=1, the tp parts joined by the rule in
the manifest.

- Multi-query (1 kv head: each tp rank keeps a copy of it), trained at tp=2 x pp=2: the shared
  `mqa_tp2_pp2` run (tests/dist/conftest.py), resumed at that layout and at dp=2.
- Grouped-query (2 kv heads: split, one to each tp rank), trained at tp=2: `gqa_tp2`
  (conftest.py here), resumed at that layout and at dp=2.

That both train like the unsplit model is tests/dist/parallel/test_tensor_parallel.py's (its
gqa-kv2 and mqa-kv1 cases); here the tp=1 resumes also follow the tp=2 runs' losses to fp32
rounding. Each case is one uninterrupted run shared by its tests, then one resume per test."""

import numpy as np
import pytest

from support.ckpt_runs import GQA, GQA_TP2, MQA, MQA_TP2_PP2, final_params, losses, run

QKV = "layers.0.attn.qkv.weight"
HEAD = 16  # rows per head: d_model 64 / 4 heads


def resume(tmp_path, corpus_cache, straight, *overrides, nproc):
    out = run(tmp_path, corpus_cache, "resumed", *overrides, f"train.resume={straight / 'checkpoints' / 'step-0000004'}",
              nproc=nproc)
    assert "resumed from step 4" in out.stderr
    return losses(tmp_path, "resumed"), final_params(tmp_path / "resumed" / "checkpoints")


def assert_bitwise(straight, got_losses, got):
    assert got_losses == losses(straight.parent, straight.name)[4:]
    want = final_params(straight / "checkpoints")
    assert got.keys() == want.keys() and len(want) > 0
    for key in want:
        assert np.array_equal(got[key], want[key]), key
    return want


def assert_resharded(straight, got_losses, got, joined):
    """The tp=1 resume: losses as the tp=2 run's, and the whole qkv as `joined` (the tp=2 run's
    parts joined by hand). Tolerance as test_resume_tp.py's, but atol 1e-4: Adam turns a last-bit
    gradient difference into a full step on a near-zero moment (measured: one element of 16384
    off by 2.3e-5); a misplaced head would be off by the weights' own size (~1e-2)."""
    assert got_losses == pytest.approx(losses(straight.parent, straight.name)[4:], rel=1e-5)
    np.testing.assert_allclose(got[QKV], joined, rtol=1e-4, atol=1e-4)


def test_mqa_tp2_pp2_checkpoint_resumes_bitwise(mqa_tp2_pp2, tmp_path, corpus_cache):
    want = assert_bitwise(mqa_tp2_pp2, *resume(tmp_path, corpus_cache, mqa_tp2_pp2, *MQA_TP2_PP2, nproc=4))
    # each tp rank saved its part with its copy of the kv head (k and v rows after its 2 q
    # heads), and the copies agree bitwise: their gradients were summed over both ranks
    kv0, kv1 = (want[f"{QKV}@tp{r}"][2 * HEAD:] for r in (0, 1))
    assert kv0.shape == (2 * HEAD, 64) and np.array_equal(kv0, kv1)


def test_mqa_tp2_pp2_checkpoint_resumes_at_tp1_pp1(mqa_tp2_pp2, tmp_path, corpus_cache):
    got_losses, got = resume(tmp_path, corpus_cache, mqa_tp2_pp2, *MQA, nproc=2)  # dp=2
    assert got[QKV].shape == ((4 + 2) * HEAD, 64)
    # q heads in rank order, then the kv head once
    want = final_params(mqa_tp2_pp2 / "checkpoints")
    part = [want[f"{QKV}@tp{r}"] for r in (0, 1)]
    assert_resharded(mqa_tp2_pp2, got_losses, got, np.concatenate([part[0][:2 * HEAD], part[1][:2 * HEAD], part[0][2 * HEAD:]]))


def test_gqa_tp2_trains_with_its_kv_heads_split(gqa_tp2):
    run_losses = losses(gqa_tp2.parent, gqa_tp2.name)
    assert len(run_losses) == 8 and all(np.isfinite(run_losses)) and run_losses[-1] < run_losses[0] - 0.5
    want = final_params(gqa_tp2 / "checkpoints")
    # each rank holds its 2 q heads and its own k and v head (4 heads of rows), not a copy
    part = [want[f"{QKV}@tp{r}"] for r in (0, 1)]
    assert part[0].shape == part[1].shape == (4 * HEAD, 64)
    assert not np.allclose(part[0][2 * HEAD:], part[1][2 * HEAD:], atol=1e-3)


def test_gqa_tp2_checkpoint_resumes_bitwise(gqa_tp2, tmp_path, corpus_cache):
    assert_bitwise(gqa_tp2, *resume(tmp_path, corpus_cache, gqa_tp2, *GQA_TP2, nproc=2))


def test_gqa_tp2_checkpoint_resumes_at_tp1(gqa_tp2, tmp_path, corpus_cache):
    got_losses, got = resume(tmp_path, corpus_cache, gqa_tp2, *GQA, nproc=2)  # dp=2
    assert got[QKV].shape == ((4 + 2 * 2) * HEAD, 64)
    # q heads in rank order, then k heads in rank order, then v heads
    want = final_params(gqa_tp2 / "checkpoints")
    part = [want[f"{QKV}@tp{r}"] for r in (0, 1)]
    rows = [(0, 2 * HEAD), (2 * HEAD, 3 * HEAD), (3 * HEAD, 4 * HEAD)]  # q, k, v in a part
    assert_resharded(gqa_tp2, got_losses, got, np.concatenate([p[a:b] for a, b in rows for p in part]))
