"""sbatch/train.sbatch submitted without the venv on PATH: the template finds the checkout's
.venv by itself, and an interpreter that cannot run mshpc stops the job before anything starts,
with one line saying what to do (exit 2, not requeued)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli_runner import REPO

pytestmark = pytest.mark.slurm

TEMPLATE = str(REPO / "sbatch/train.sbatch")
CONFIG = str(REPO / "configs/tiny.yaml")
VENV_BIN = Path(sys.executable).parent


def without_venv(slurm) -> None:
    """Submit as a user who has not activated the venv: no MSHPC_PYTHON, no venv on PATH."""
    slurm.env.pop("MSHPC_PYTHON", None)
    slurm.env.pop("VIRTUAL_ENV", None)
    path = [p for p in slurm.env.get("PATH", "").split(os.pathsep) if p and Path(p) != VENV_BIN]
    slurm.env["PATH"] = os.pathsep.join(path)


def test_without_the_venv_on_path_the_checkouts_venv_is_found(slurm, corpus_cache):
    venv_python = REPO / ".venv/bin/python"
    if not venv_python.exists():
        pytest.skip(f"no {venv_python}: the checkout's venv is what this test finds")
    without_venv(slurm)
    job = slurm.sbatch("--nodes=1", TEMPLATE, CONFIG, *slurm.train_sets(corpus_cache, "train.steps=2"))
    info = slurm.wait_done(job)
    log = slurm.batch_log(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert f"mshpc: python {venv_python}\n" in log


def test_an_interpreter_without_mshpc_stops_the_job_with_one_line(slurm, corpus_cache):
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK) or subprocess.run([python, "-c", "import mshpc, torch"], cwd=slurm.cwd,
                                                         capture_output=True).returncode == 0:
        pytest.skip(f"needs a {python} that cannot import mshpc and torch")
    without_venv(slurm)
    job = slurm.sbatch("--nodes=1", TEMPLATE, CONFIG, *slurm.train_sets(corpus_cache, "train.steps=2"),
                       env={"MSHPC_PYTHON": python})
    info = slurm.wait_done(job)
    log = slurm.batch_log(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), log
    errors = [line for line in log.splitlines() if line.startswith("mshpc: error:")]
    assert errors == [f"mshpc: error: no python here can import mshpc and torch ({python}: ModuleNotFoundError: "
                      f"No module named 'mshpc'): run `make` in {REPO} to create its .venv, or submit with "
                      "MSHPC_PYTHON=/path/to/venv/bin/python"], log
    assert "Traceback" not in log and not (slurm.cwd / "logs").exists()  # stopped before any rank started
    job = slurm.sbatch("--nodes=1", TEMPLATE, CONFIG, env={"MSHPC_HOME": str(slurm.cwd)})
    info = slurm.wait_done(job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0")
    assert f"mshpc: error: no mshpc checkout at '{slurm.cwd}' (submit with MSHPC_HOME=/path/to/mshpc)" in \
        slurm.batch_log(job)
