"""Shared by the checkpoint tests: train, kill, resume through the real CLI; read the results."""

from pathlib import Path

import h5py
import numpy as np

from cli_runner import mshpc, read_metrics, train_args

STEPS = 8
# max_restarts=0: these tests restart by hand, to see what a crash leaves (tests/faults: on its own)
CKPT = ["checkpoint.interval_steps=4", "checkpoint.keep=3", f"train.steps={STEPS}", "supervisor.max_restarts=0"]


def run(tmp_path, cache, name, *overrides, nproc=2, faults=None, expect=0):
    out = mshpc(*train_args(tmp_path, cache, *CKPT, *overrides, name=name), "--nproc", str(nproc),
                env={"MSHPC_TEST_FAULTS": faults} if faults else None)
    assert out.returncode == expect, out.stderr[-3000:]
    return out


def losses(tmp_path, name):
    return [r["loss"] for r in read_metrics(tmp_path / name)]


def final_params(ckpt_root: Path) -> dict[str, np.ndarray]:
    """Model tensors of the latest checkpoint, read with plain h5py."""
    with h5py.File(ckpt_root / "latest" / "shard-00000.h5", "r") as f:
        return {k: f["model"][k][()] for k in f["model"]}
