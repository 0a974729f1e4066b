import pytest

from support.ckpt_runs import GQA_TP2, run


@pytest.fixture(scope="session")
def straight(tmp_path_factory, corpus_cache):
    """The undisturbed reference run: dp=2, STEPS steps, checkpoints at 4 and 8."""
    tmp = tmp_path_factory.mktemp("straight")
    run(tmp, corpus_cache, "straight")
    return tmp


@pytest.fixture(scope="session")
def gqa_tp2(tmp_path_factory, corpus_cache):
    """The run directory of a grouped-query model (4 heads, 2 kv heads) trained STEPS steps at
    tp=2 (2 ranks, dp=1), checkpoints at 4 and 8: test_resume_gqa.py's uninterrupted reference."""
    tmp = tmp_path_factory.mktemp("gqa")
    run(tmp, corpus_cache, "tp2", *GQA_TP2, nproc=2)
    return tmp / "tp2"
