"""Shared by the checkpoint tests: train, kill, resume through the real CLI; read the results."""

from pathlib import Path

import h5py
import numpy as np
import torch

from mshpc.checkpoint.h5_shard import write_shard
from mshpc.checkpoint.manifest import Manifest, write_manifest
from mshpc.tensor_slice import TensorSlice
from support.cli_runner import mshpc, read_metrics, train_args

STEPS = 8
# max_restarts=0: these tests restart by hand, to see what a crash leaves (tests/faults: on its own)
CKPT = ["checkpoint.interval_steps=4", "checkpoint.keep=3", f"train.steps={STEPS}", "supervisor.max_restarts=0"]

# multi-query attention (4 heads, 1 kv head: each tp rank keeps a copy of it) at tp=2 x pp=2,
# dp=1: a global batch of 16 as the dp=2 runs have
MQA = ["model.n_head=4", "model.n_kv_head=1"]
MQA_TP2_PP2 = [*MQA, "parallel.tp=2", "parallel.pp=2", "train.micro_batch=4", "train.grad_accum=4"]
# grouped-query attention (4 heads, 2 kv heads: split, one to each tp rank) at tp=2, dp=1: the
# same global batch of 16
GQA = ["model.n_head=4", "model.n_kv_head=2"]
GQA_TP2 = [*GQA, "parallel.tp=2", "train.micro_batch=8", "train.grad_accum=2"]


def run(tmp_path, cache, name, *overrides, nproc=2, faults=None, expect=0):
    out = mshpc(*train_args(tmp_path, cache, *CKPT, *overrides, name=name), "--nproc", str(nproc),
                env={"MSHPC_TEST_FAULTS": faults} if faults else None)
    assert out.returncode == expect, out.stderr[-3000:]
    return out


def losses(tmp_path, name):
    return [r["loss"] for r in read_metrics(tmp_path / name)]


def final_params(ckpt_root: Path) -> dict[str, np.ndarray]:
    """Model tensors of the latest checkpoint (from every shard: each tp rank writes its own),
    read with plain h5py."""
    out = {}
    for shard in sorted((ckpt_root / "latest").glob("shard-*.h5")):
        with h5py.File(shard, "r") as f:
            out.update({k: f["model"][k][()] for k in f.get("model", {})})
    return out


def kill_and_resume(tmp_path: Path, cache: Path, name: str, overrides: list[str],
                    straight: Path) -> dict[str, np.ndarray]:
    """Train `name` with rank 1 killed -9 at step 6 (after the step-4 save), resume it, and check
    that its losses and final parameters are bitwise those of the undisturbed run directory
    `straight`; returns those parameters, by name."""
    run(tmp_path, cache, name, *overrides, "checkpoint.async_save=false", faults="kill:rank=1:step=6", expect=137)
    out = run(tmp_path, cache, name, *overrides)
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, name) == losses(straight.parent, straight.name)
    want, got = final_params(straight / "checkpoints"), final_params(tmp_path / name / "checkpoints")
    assert want.keys() == got.keys() and len(want) > 0
    for key in want:
        assert np.array_equal(want[key], got[key]), key
    return want


def sharded_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], n_shards: int,
                       whole: dict[str, tuple[torch.Tensor, int]] | None = None, tp: int = 1,
                       extras: dict | None = None) -> Manifest:
    """Write each of `tensors` as n_shards flat slices, one shard file per slice index, like
    ZeRO ranks would; each of `whole` (name -> (tensor, shard index)) goes whole into one shard.
    `tp` and `extras` go into the manifest as they are."""
    items: list[dict[str, TensorSlice]] = [{} for _ in range(n_shards)]
    for name, full in tensors.items():
        flat = full.reshape(-1)
        bounds = [len(flat) * i // n_shards for i in range(n_shards + 1)]
        for r in range(n_shards):
            items[r][name] = TensorSlice(flat[bounds[r]:bounds[r + 1]].clone(), tuple(full.shape), bounds[r])
    for name, (t, r) in (whole or {}).items():
        items[r][name] = TensorSlice.whole(t)
    entries = [e for r in range(n_shards) for e in write_shard(folder / f"shard-{r:05d}.h5", items[r])]
    m = Manifest(step=3, config_hash="abc", layout={"dp": n_shards, "tp": tp, "pp": 1},
                 tensors=tuple(entries), extras={"step": 3, **(extras or {})})
    write_manifest(folder, m)
    return m
