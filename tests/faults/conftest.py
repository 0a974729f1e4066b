import pytest

from support.ckpt_runs import final_params
from support.cli_runner import read_metrics
from support.fault_runs import supervised


@pytest.fixture(scope="session")
def reference(tmp_path_factory, corpus_cache):
    """The undisturbed run: its final parameters and losses."""
    tmp = tmp_path_factory.mktemp("reference")
    out = supervised(tmp, corpus_cache, "ref")
    assert out.returncode == 0, out.stderr[-3000:]
    return final_params(tmp / "ref" / "checkpoints"), [r["loss"] for r in read_metrics(tmp / "ref")]
