"""A ZeRO stage-3 checkpoint is a stage-2 checkpoint: through the real CLI, a stage-3 run killed
after a save resumes at stage 2, is killed again, resumes at stage 3 and ends bitwise where an
undisturbed stage-3 run ends (stage 3 trains bitwise as stage 2: tests/dist/parallel/test_zero3.py);
and a dp 2 checkpoint of stage 3 resumes at dp 4, at stage 3.
"""

import shutil

import numpy as np
import pytest
from support.cli_runner import mshpc, read_metrics, train_args

from mshpc.checkpoint.model_copy import read_model_copy

STEPS = 12
SAVES = ["checkpoint.interval_steps=4", f"train.steps={STEPS}", "supervisor.max_restarts=0",
         "checkpoint.async_save=false"]  # a synchronous save commits before the kill can come
STAGE3 = "parallel.zero_stage=3"


def run(tmp_path, cache, name, *overrides, faults=None, expect=0):
    out = mshpc(*train_args(tmp_path, cache, *SAVES, *overrides, name=name), "--nproc", "2",
                env={"MSHPC_TEST_FAULTS": faults} if faults else None)
    assert out.returncode == expect, out.stderr[-3000:]
    return out


def losses(tmp_path, name):
    return [r["loss"] for r in read_metrics(tmp_path / name)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus_cache):
    tmp = tmp_path_factory.mktemp("zero3")
    run(tmp, corpus_cache, "straight", STAGE3)
    return tmp


def test_stage3_resumes_at_stage2_and_back_bitwise(straight, tmp_path, corpus_cache):
    run(tmp_path, corpus_cache, "chain", STAGE3, faults="kill:rank=1:step=6", expect=137)
    out = run(tmp_path, corpus_cache, "chain", faults="kill:rank=0:step=10", expect=137)  # stage 2
    assert "resumed from step 4" in out.stderr
    out = run(tmp_path, corpus_cache, "chain", STAGE3)
    assert "resumed from step 8" in out.stderr
    assert len(losses(tmp_path, "chain")) == STEPS
    assert losses(tmp_path, "chain") == losses(straight, "straight")
    # the model/ copy that export reads: sliced over the ranks at stage 3, read whole alike
    want = read_model_copy(straight / "straight" / "checkpoints" / "latest")
    got = read_model_copy(tmp_path / "chain" / "checkpoints" / "latest")
    assert want.keys() == got.keys() and len(want) > 0
    for name in want:
        assert np.array_equal(want[name].numpy(), got[name].numpy()), name


def test_stage3_checkpoint_resumes_at_dp4(straight, tmp_path, corpus_cache):
    # the same global batch (4 x 4 sequences): equal within fp tolerance, as a stage-2 dp change
    # (tests/dist/checkpoint/test_resume.py); each rank cuts its shards of the whole tensors anew
    step = "step-0000008"
    root = tmp_path / "dp4" / "checkpoints"
    root.mkdir(parents=True)
    shutil.copytree(straight / "straight" / "checkpoints" / step, root / step)
    (root / "latest").symlink_to(step)
    out = mshpc(*train_args(tmp_path, corpus_cache, *SAVES, STAGE3, "train.micro_batch=4", name="dp4"),
                "--nproc", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from step 8" in out.stderr
    assert losses(tmp_path, "dp4") == pytest.approx(losses(straight, "straight")[8:], rel=1e-5)
