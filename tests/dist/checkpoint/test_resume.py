"""Bit-exact resume after a kill -9, at the same layout and at another one."""

import shutil
import subprocess

import numpy as np
import pytest

from ckpt_runs import STEPS, final_params, losses, run
from cli_runner import mshpc


def test_killed_and_resumed_run_is_bitwise_identical(straight, tmp_path, corpus_cache):
    # a synchronous save commits before training goes on, so the kill surely follows a commit
    # (async saves under a kill are the crash-safety tests' business)
    run(tmp_path, corpus_cache, "b", "checkpoint.async_save=false", faults="kill:rank=0:step=6", expect=137)
    assert len(losses(tmp_path, "b")) == 6  # steps 1-6 logged before the kill, 4 checkpointed
    out = run(tmp_path, corpus_cache, "b")
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, "b") == losses(straight, "straight")  # steps 5-6 retrained, not kept twice
    want, got = final_params(straight / "straight" / "checkpoints"), final_params(tmp_path / "b" / "checkpoints")
    assert want.keys() == got.keys() and len(want) > 0
    for name in want:
        assert np.array_equal(want[name], got[name]), name


def test_dp2_checkpoint_resumes_at_dp1(straight, tmp_path, corpus_cache):
    # same global batch (16 sequences) on one rank: only the summation order of grads changes,
    # so the result is equal within fp tolerance, not bitwise
    run(tmp_path, corpus_cache, "c", "checkpoint.async_save=false", faults="kill:rank=1:step=5", expect=137)
    out = run(tmp_path, corpus_cache, "c", "train.micro_batch=16", nproc=1)
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, "c") == pytest.approx(losses(straight, "straight"), rel=1e-5)
    want, got = final_params(straight / "straight" / "checkpoints"), final_params(tmp_path / "c" / "checkpoints")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)


def test_ckpt_tools_on_a_real_run(straight):
    root = straight / "straight" / "checkpoints"
    inspect = mshpc("ckpt", "inspect", str(root))
    assert inspect.returncode == 0 and f"step {STEPS}, dp=2 tp=1 pp=1" in inspect.stdout
    verify = mshpc("ckpt", "verify", str(root))
    assert verify.returncode == 0 and verify.stdout.count(": OK") == 2
    if shutil.which("h5ls") is None:
        pytest.skip("h5ls is not installed (Debian's hdf5-tools; make test installs it as root)")
    h5ls = subprocess.run(["h5ls", "-r", str(root / "latest" / "shard-00000.h5")], capture_output=True, text=True)
    assert "/model/layers.0.attn.qkv.weight Dataset" in h5ls.stdout


def test_single_rank_kill_and_resume_is_bitwise_identical(tmp_path, corpus_cache):
    run(tmp_path, corpus_cache, "one", "train.micro_batch=16", nproc=1)
    run(tmp_path, corpus_cache, "one-b", "train.micro_batch=16", "checkpoint.async_save=false",
        nproc=1, faults="kill:rank=0:step=5", expect=-9)  # one rank runs in-process: no launcher
    out = run(tmp_path, corpus_cache, "one-b", "train.micro_batch=16", nproc=1)
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, "one-b") == losses(tmp_path, "one")
    want, got = final_params(tmp_path / "one" / "checkpoints"), final_params(tmp_path / "one-b" / "checkpoints")
    for name in want:
        assert np.array_equal(want[name], got[name]), name
