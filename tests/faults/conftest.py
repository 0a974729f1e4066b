import pytest

from support.ckpt_runs import final_params
from support.cli_runner import read_metrics
from support.fault_runs import supervised


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, corpus_cache):
    """The undisturbed run's directory (read it, or copy it: never change it)."""
    tmp = tmp_path_factory.mktemp("reference")
    out = supervised(tmp, corpus_cache, "ref")
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp / "ref"


@pytest.fixture(scope="session")
def reference(reference_run):
    """The undisturbed run: its final parameters and losses."""
    return final_params(reference_run / "checkpoints"), [r["loss"] for r in read_metrics(reference_run)]
