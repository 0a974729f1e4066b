"""mshpc.submit without Slurm: parameter checks, time limits, and cluster="local" end to end."""

import subprocess
import sys

import pytest

import mshpc
from support.cli_runner import REPO, SMALL
from mshpc.errors import ConfigError
from mshpc.launch.submit import check_slurm_parameters, slurm_parameters, time_minutes


def test_import_mshpc_stays_light():
    code = "import sys, mshpc; print('torch' in sys.modules, 'submitit' in sys.modules, callable(mshpc.submit))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True"]


def test_unknown_slurm_parameter_lists_the_valid_ones():
    check_slurm_parameters({"account": "proj", "qos": "high", "exclude": "n3"})
    with pytest.raises(ConfigError) as err:
        check_slurm_parameters({"acount": "proj"})
    assert str(err.value) == (f"unknown Slurm parameter 'acount' (did you mean 'account'? "
                              f"valid: {', '.join(slurm_parameters())})")
    assert "nodes" not in slurm_parameters()  # submit()'s own arguments


@pytest.mark.parametrize("limit, minutes", [(90, 90), ("90", 90), ("30:30", 31), ("01:30:00", 90),
                                            ("2-00", 2880), ("1-01:00:01", 1501)])
def test_slurm_time_limits(limit, minutes):
    assert time_minutes(limit) == minutes


def test_bad_time_limit_and_cluster():
    with pytest.raises(ConfigError, match="time='1h' is not a Slurm time limit"):
        time_minutes("1h")
    with pytest.raises(ConfigError, match=r"cluster='pbs' \(choose slurm, local"):
        mshpc.submit(REPO / "configs/tiny.yaml", cluster="pbs")


def test_sweep_configs_need_their_own_run_directories(tmp_path):
    with pytest.raises(ConfigError, match="share run directories"):
        mshpc.submit_sweep([REPO / "configs/tiny.yaml"] * 2, cluster="local", folder=tmp_path)


def test_local_cluster_runs_the_job_without_slurm(tmp_path, corpus_cache):
    sets = [*SMALL, "train.steps=3", f"run.out_dir={tmp_path}", f"data.cache_dir={corpus_cache}"]
    job = mshpc.submit(REPO / "configs/tiny.yaml", overrides=sets, cluster="local", time=5)
    result = job.result(timeout_s=240)
    assert result.run_dir == tmp_path / "tiny" and result.steps == 3
    assert "rank 0/2" in job.log(0)  # the config's two ranks, started by the local launcher
