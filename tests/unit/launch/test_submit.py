"""mshpc.submit without Slurm: parameter checks, time limits, and cluster="local" end to end."""

import subprocess
import sys

import pytest

import mshpc
from support.cli_runner import REPO, SMALL
from mshpc.config import load_config
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


@pytest.mark.parametrize("name", ['"a\\ntouch /tmp/mshpc-pwned\\n#"', "x;id"])
def test_run_name_is_a_plain_name_or_one_line_and_exit_2(tmp_path, name):
    # issue #43, finding 4: a newline in run.name ran commands in the sbatch script `mshpc submit`
    # writes, and made sbatch drop every later #SBATCH line
    out = subprocess.run([sys.executable, "-m", "mshpc", "submit", str(REPO / "configs/tiny.yaml"), "--cluster",
                          "local", "--set", f"run.name={name}", "--set", f"run.out_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("mshpc: error: ConfigError: run.name=") and "is not a plain name" in line
    assert not any(tmp_path.iterdir())  # nothing written, nothing submitted


@pytest.mark.parametrize("name", ["a b", "../up", "''", "é", "a" * 129, ".", "tab\\there"])
def test_run_name_refusals(name):
    with pytest.raises(ConfigError, match=r"run.name=.* is not a plain name"):
        load_config(REPO / "configs/tiny.yaml", [f"run.name={name}"])
    assert load_config(REPO / "configs/tiny.yaml", ["run.name=gpt-125m_v2.1"]).run.name == "gpt-125m_v2.1"


def test_every_value_of_the_job_script_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"Slurm parameter account='proj\\ntouch x' holds a control character"):
        mshpc.submit(REPO / "configs/tiny.yaml", cluster="local", folder=tmp_path, account="proj\ntouch x")
    with pytest.raises(ConfigError, match=r"Slurm parameter additional_parameters.mail-user=.*control character"):
        check_slurm_parameters({"additional_parameters": {"mail-user": "a@b\n#SBATCH --x"}})
    with pytest.raises(ConfigError, match=r"run.out_dir='r\\nx' holds a control character"):
        mshpc.submit(REPO / "configs/tiny.yaml", overrides=['run.out_dir="r\\nx"'], cluster="local", folder=tmp_path)
