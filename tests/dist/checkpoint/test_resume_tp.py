"""Tensor parallelism through the real CLI: tp=2 and dp=2 x tp=2 train like dp=2 on the same
global batch, and a tp=2 run killed with -9 resumes bitwise (tp shards saved per tp rank)."""

import pytest

from ckpt_runs import CKPT, kill_and_resume, losses, run
from cli_runner import mshpc, train_args

TP2 = ["parallel.tp=2", "train.micro_batch=16"]  # dp=1: the straight run's global batch of 16


@pytest.fixture(scope="module")
def tp_straight(tmp_path_factory, corpus_cache):
    tmp = tmp_path_factory.mktemp("tp")
    run(tmp, corpus_cache, "tp", *TP2)
    return tmp


def test_tp2_trains_like_dp2(straight, tp_straight):
    assert losses(tp_straight, "tp") == pytest.approx(losses(straight, "straight"), rel=1e-5)


def test_dp2_tp2_trains_like_dp2(straight, tmp_path, corpus_cache):
    # 4 ranks; the tp pair of each dp rank reads that dp rank's batch
    run(tmp_path, corpus_cache, "dp2tp2", "parallel.tp=2", "checkpoint.interval_steps=0", nproc=4)
    assert losses(tmp_path, "dp2tp2") == pytest.approx(losses(straight, "straight"), rel=1e-5)


def test_tp2_killed_and_resumed_run_is_bitwise_identical(tp_straight, tmp_path, corpus_cache):
    want = kill_and_resume(tmp_path, corpus_cache, "tp-b", TP2, tp_straight / "tp")
    # each tp rank's shard under its own name; the norms (whole on both) once
    assert {"layers.0.attn.qkv.weight@tp0", "layers.0.attn.qkv.weight@tp1", "norm.weight"} <= set(want)


def test_tp2_checkpoint_at_another_tp_stops_with_the_reason(tp_straight, tmp_path, corpus_cache):
    # tp shards are stored per tp rank and do not reshard: say so, not "missing tensor"
    folder = tp_straight / "tp" / "checkpoints" / "latest"
    out = mshpc(*train_args(tmp_path, corpus_cache, *CKPT, "train.micro_batch=16", f"train.resume={folder}",
                            name="tp1"), "--nproc", "1")
    assert out.returncode == 2 and "written at parallel.tp=2" in out.stderr, out.stderr[-2000:]
