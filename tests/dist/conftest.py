import pytest

from support.ckpt_runs import MQA_TP2_PP2, run


@pytest.fixture(scope="session")
def mqa_tp2_pp2(tmp_path_factory, corpus_cache):
    """The run directory of a multi-query model trained 8 steps at tp=2 x pp=2 (4 ranks), with
    checkpoints at steps 4 and 8: resumed by checkpoint/test_resume_gqa.py, generated from by
    test_generate.py (one run for both: the suite's time)."""
    tmp = tmp_path_factory.mktemp("mqa")
    run(tmp, corpus_cache, "tp2pp2", *MQA_TP2_PP2, nproc=4)
    return tmp / "tp2pp2"
