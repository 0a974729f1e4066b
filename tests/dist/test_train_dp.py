"""Data-parallel training end to end through the real CLI and local launcher (gloo ranks)."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from support.cli_runner import mshpc, read_metrics, train_args

STEPS = "train.steps=6"


def losses(tmp_path, cache, nproc, *overrides, name):
    out = mshpc(*train_args(tmp_path, cache, STEPS, *overrides, name=name), "--nproc", str(nproc))
    assert out.returncode == 0, out.stderr[-3000:]
    return [r["loss"] for r in read_metrics(tmp_path / name)]


def test_dp2_equals_dp1_with_the_same_global_batch(tmp_path, corpus_cache):
    dp1 = losses(tmp_path, corpus_cache, 1, "train.micro_batch=8", name="dp1")
    dp2 = losses(tmp_path, corpus_cache, 2, "train.micro_batch=4", name="dp2")
    accum = losses(tmp_path, corpus_cache, 1, "train.micro_batch=4", "train.grad_accum=2", name="accum")
    assert len(dp1) == 6
    assert dp2 == pytest.approx(dp1, rel=1e-5, abs=1e-6)
    assert accum == pytest.approx(dp1, rel=1e-5, abs=1e-6)
    # the optimizer really moves the weights: the loss is not flat
    assert dp1[-1] < dp1[0]


def test_run_directory_holds_resolved_config_and_metrics(tmp_path, corpus_cache):
    out = mshpc(*train_args(tmp_path, corpus_cache, "train.steps=3", "optim.name=lamb", name="r"), "--nproc", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "r"
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["parallel"]["dp"] == 2 and resolved["optim"]["name"] == "lamb"
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "step_time_s", "mfu"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert r["mfu"] is None  # no known peak for a CPU
    # rank 0's plain progress lines (stdout is not a TTY here)
    assert "step 3/3 loss" in out.stdout
    # the resolved config reloads and runs again as it is
    rerun = mshpc("train", str(run / "config.yaml"), "--set", "run.name=r2", "--set", "train.steps=1")
    assert rerun.returncode == 0, rerun.stderr[-3000:]


def test_mpiexec_bootstrap_gives_the_same_run(tmp_path, corpus_cache):
    # the mpich wheel puts mpiexec beside the venv's python
    mpiexec = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if mpiexec is None:
        pytest.skip("mpiexec is not installed (pip install mpich)")
    local = losses(tmp_path, corpus_cache, 2, "train.micro_batch=4", name="local")
    out = mshpc(*train_args(tmp_path, corpus_cache, STEPS, "train.micro_batch=4", name="mpi"),
                launcher=(mpiexec, "-n", "2"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "via mpi" in out.stderr
    assert [r["loss"] for r in read_metrics(tmp_path / "mpi")] == pytest.approx(local, rel=1e-6)
