"""Pipeline-parallel training end to end through the real CLI and local launcher: pp=2 matches
single-rank training of the same global batch, a run killed and resumed at pp=2 is bitwise
the run that was never interrupted, and a checkpoint resumes across pp=1 and pp=2 (equal within
fp tolerance: the sums' order changes with the layout)."""

import numpy as np
import pytest

from support.ckpt_runs import final_params, kill_and_resume, losses, run

PP2 = ["parallel.pp=2", "train.micro_batch=4", "train.grad_accum=4"]  # 16 sequences, 4 micro-batches
ONE = ["train.micro_batch=16"]  # the same global batch on one rank


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus_cache):
    tmp = tmp_path_factory.mktemp("pp-straight")
    run(tmp, corpus_cache, "pp2", *PP2)
    return tmp


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, corpus_cache):
    tmp = tmp_path_factory.mktemp("pp-one")
    run(tmp, corpus_cache, "one", *ONE, nproc=1)
    return tmp


def test_pp2_trains_like_one_rank_on_the_same_global_batch(straight, one_rank):
    # the same sums in another order (micro-batches, stages): equal within fp32 rounding
    assert losses(straight, "pp2") == pytest.approx(losses(one_rank, "one"), rel=1e-5)
    want, got = final_params(one_rank / "one" / "checkpoints"), final_params(straight / "pp2" / "checkpoints")
    # both stages wrote their weights under full-model names; the last stage its copy of the tied head
    assert set(got) == set(want) | {"lm_head.weight"}
    # atol as _assert_close's: Adam turns a last-bit gradient difference into a full step on a
    # near-zero moment (measured on the corpus with its validation split held out: one element of
    # 16384 off by 3.5e-6); a misplaced slice would be off by the weights' own size (~1e-2)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
    assert np.array_equal(got["lm_head.weight"], got["tok_embeddings.weight"])


def test_pp2_killed_and_resumed_is_bitwise_identical(straight, tmp_path, corpus_cache):
    kill_and_resume(tmp_path, corpus_cache, "b", PP2, straight / "pp2")


def _assert_close(got, want):
    # see test_resume_tp.py: Adam makes a last-bit gradient difference a ~1e-6 weight difference
    # (one element of layers.1's v rows 1.4e-5 on the corpus with its validation split held out)
    assert len(want) > 0
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_pp2_checkpoint_resumes_on_one_rank(straight, one_rank, tmp_path, corpus_cache):
    out = run(tmp_path, corpus_cache, "one", *ONE, f"train.resume={straight / 'pp2/checkpoints/step-0000004'}", nproc=1)
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, "one") == pytest.approx(losses(one_rank, "one")[4:], rel=1e-5)
    _assert_close(final_params(tmp_path / "one" / "checkpoints"), final_params(one_rank / "one" / "checkpoints"))


def test_one_rank_checkpoint_resumes_at_pp2(straight, one_rank, tmp_path, corpus_cache):
    # the last stage's copy of the tied embedding is read under the name pp=1 saved it as
    out = run(tmp_path, corpus_cache, "pp2", *PP2, f"train.resume={one_rank / 'one/checkpoints/step-0000004'}")
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, "pp2") == pytest.approx(losses(straight, "pp2")[4:], rel=1e-5)
    got = final_params(tmp_path / "pp2" / "checkpoints")
    _assert_close(got, final_params(straight / "pp2" / "checkpoints"))
    assert np.array_equal(got["lm_head.weight"], got["tok_embeddings.weight"])


def test_tp2_pp2_checkpoint_resumes_on_one_rank(one_rank, tmp_path, corpus_cache):
    # 4 ranks; each stage's tp split rules reach the manifest rank 0 writes, so the layers of
    # the stage rank 0 does not hold are joined too
    run(tmp_path, corpus_cache, "tp2pp2", *PP2, "parallel.tp=2", nproc=4)
    assert losses(tmp_path, "tp2pp2") == pytest.approx(losses(one_rank, "one"), rel=1e-5)
    step4 = tmp_path / "tp2pp2" / "checkpoints" / "step-0000004"
    out = run(tmp_path, corpus_cache, "one", *ONE, f"train.resume={step4}", nproc=1)
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, "one") == pytest.approx(losses(one_rank, "one")[4:], rel=1e-5)
    _assert_close(final_params(tmp_path / "one" / "checkpoints"), final_params(one_rank / "one" / "checkpoints"))
