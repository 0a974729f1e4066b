"""Pipeline-parallel training end to end through the real CLI and local launcher: pp=2 matches
single-rank training of the same global batch, and a run killed and resumed at pp=2 is bitwise
the run that was never interrupted."""

import numpy as np
import pytest

from ckpt_runs import final_params, kill_and_resume, losses, run

PP2 = ["parallel.pp=2", "train.micro_batch=4", "train.grad_accum=4"]  # 16 sequences, 4 micro-batches


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus_cache):
    tmp = tmp_path_factory.mktemp("pp-straight")
    run(tmp, corpus_cache, "pp2", *PP2)
    return tmp


def test_pp2_trains_like_one_rank_on_the_same_global_batch(straight, tmp_path, corpus_cache):
    run(tmp_path, corpus_cache, "one", "train.micro_batch=16", nproc=1)
    # the same sums in another order (micro-batches, stages): equal within fp32 rounding
    assert losses(straight, "pp2") == pytest.approx(losses(tmp_path, "one"), rel=1e-5)
    want, got = final_params(tmp_path / "one" / "checkpoints"), final_params(straight / "pp2" / "checkpoints")
    # both stages wrote their weights under full-model names; the last stage its copy of the tied head
    assert set(got) == set(want) | {"lm_head.weight"}
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)
    assert np.array_equal(got["lm_head.weight"], got["tok_embeddings.weight"])


def test_pp2_killed_and_resumed_is_bitwise_identical(straight, tmp_path, corpus_cache):
    kill_and_resume(tmp_path, corpus_cache, "b", PP2, straight / "pp2")
