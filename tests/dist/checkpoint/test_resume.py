"""Bit-exact resume after a kill -9, at the same layout and at another one."""

import shutil
import subprocess

import numpy as np
import pytest

from support.ckpt_runs import STEPS, final_params, losses, run
from support.cli_runner import mshpc, read_metrics
from mshpc.checkpoint.manifest import read_manifest
from mshpc.checkpoint.shard_read import entry_nbytes
from mshpc.events import read_events


def assert_each_byte_read_once(run_dir, folder, nproc, same_world):
    """MegaScale's restore, seen in the resume's own accounting: all ranks together read exactly
    the entries a resume needs (the weights are rebuilt from the masters; RNG states only at the
    same world size), none twice, and every rank takes part."""
    event = [e for e in read_events(run_dir) if e["kind"] == "checkpoint_restore"][-1]
    needed = [e for e in read_manifest(folder).tensors
              if not e.name.startswith("model/") and (same_world or not e.name.startswith("rng/"))]
    assert sum(event["bytes_read"]) == sum(entry_nbytes(e) for e in needed)
    assert sum(event["entries_read"]) == len(needed)
    assert len(event["bytes_read"]) == nproc and all(b > 0 for b in event["bytes_read"])
    return event


def test_killed_and_resumed_run_is_bitwise_identical(straight, tmp_path, corpus_cache):
    # a synchronous save commits before training goes on, so the kill surely follows a commit
    # (async saves under a kill are the crash-safety tests' business); DALI here (the reference
    # run has the torch loader): its resumed pipeline yields the same batches, bit for bit
    run(tmp_path, corpus_cache, "b", "checkpoint.async_save=false", "data.loader=auto", faults="kill:rank=0:step=6",
        expect=137)
    assert len(losses(tmp_path, "b")) == 6  # steps 1-6 logged before the kill, 4 checkpointed
    out = run(tmp_path, corpus_cache, "b", "data.loader=auto")
    assert "resumed from step 4" in out.stderr and "data loader: dali" in out.stderr
    event = assert_each_byte_read_once(tmp_path / "b", tmp_path / "b" / "checkpoints" / "step-0000004", 2, True)
    assert sum(event["bytes_received"]) == 4  # each rank reads its own shard; only the fp32 step counter travels
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
    assert_each_byte_read_once(tmp_path / "c", tmp_path / "c" / "checkpoints" / "step-0000004", 1, False)
    assert losses(tmp_path, "c") == pytest.approx(losses(straight, "straight"), rel=1e-5)
    want, got = final_params(straight / "straight" / "checkpoints"), final_params(tmp_path / "c" / "checkpoints")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)


def test_dp2_checkpoint_resumes_at_dp4_reading_each_byte_once(straight, tmp_path, corpus_cache):
    # each saved half is needed by two dp=4 ranks: one reads it, the other gets it by broadcast;
    # same global batch (4 x 4 sequences), so equal within fp tolerance as at dp=1
    run(tmp_path, corpus_cache, "q", "checkpoint.async_save=false", faults="kill:rank=1:step=5", expect=137)
    out = run(tmp_path, corpus_cache, "q", "train.micro_batch=4", nproc=4)
    assert "resumed from step 4" in out.stderr
    event = assert_each_byte_read_once(tmp_path / "q", tmp_path / "q" / "checkpoints" / "step-0000004", 4, False)
    assert all(b > 0 for b in event["bytes_received"])
    assert losses(tmp_path, "q") == pytest.approx(losses(straight, "straight"), rel=1e-5)
    want, got = final_params(straight / "straight" / "checkpoints"), final_params(tmp_path / "q" / "checkpoints")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)


def test_metrics_hold_each_saves_blocking_and_the_next_updates_wait_for_stage_1(straight):
    rows = {r["step"]: r for r in read_metrics(straight / "straight")}
    assert [s for s, r in rows.items() if r["ckpt_blocking_s"] is not None] == [4, STEPS]
    # stage 1 of step 4's save overlapped step 5's forward and backward; step 8's has no next
    # update (the run's end waits for it)
    waits = {s: r["ckpt_stage1_wait_s"] for s, r in rows.items() if r["ckpt_stage1_wait_s"] is not None}
    assert list(waits) == [5] and 0 <= waits[5] < 60


def test_ckpt_tools_on_a_real_run(straight):
    root = straight / "straight" / "checkpoints"
    inspect = mshpc("ckpt", "inspect", str(root))
    assert inspect.returncode == 0 and f"step {STEPS}, dp=2 tp=1 pp=1" in inspect.stdout
    verify = mshpc("ckpt", "verify", str(root))
    assert verify.returncode == 0 and verify.stdout.count(": OK") == 2
    if shutil.which("h5ls") is None:
        pytest.skip("h5ls is not installed (Debian's hdf5-tools; make test installs it as root)")
    listings = [subprocess.run(["h5ls", "-r", str(root / "latest" / f"shard-0000{r}.h5")], capture_output=True,
                               text=True, check=True).stdout for r in range(2)]
    # each weight whole in one dp rank's shard, both ranks holding some (state.spread)
    assert sum("/model/layers.0.attn.qkv.weight Dataset" in out for out in listings) == 1
    assert all("/model/" in out for out in listings)


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
