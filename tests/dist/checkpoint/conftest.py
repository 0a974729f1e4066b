import pytest

from support.ckpt_runs import run


@pytest.fixture(scope="session")
def straight(tmp_path_factory, corpus_cache):
    """The undisturbed reference run: dp=2, STEPS steps, checkpoints at 4 and 8."""
    tmp = tmp_path_factory.mktemp("straight")
    run(tmp, corpus_cache, "straight")
    return tmp
