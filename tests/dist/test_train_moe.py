"""Mixtures of experts trained end to end through the real CLI (gloo ranks): expert parallelism
equals ep=1 (ep=2 on 2 ranks; ep=2 x tp=2 x pp=2 on 8), the metrics, checkpoints by global
expert index resumed bitwise at the same layout and at ep=1 and ep=4, `mshpc ckpt` on experts.

One module fixture trains each layout once (the 8-rank run once in the suite); the router is
DeepSeek's sigmoid with its bias (moved after every step, checkpointed) and the Switch loss on
top, so that every part of the layer's state crosses the checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import pytest
from support.cli_runner import mshpc, read_metrics, train_args

from mshpc.checkpoint.tools import inspect, verify

STEPS, SAVE_AT = 20, 16
MOE = ["model.mlp=swiglu", "model.parallel_block=false", "model.moe={}", "model.moe.n_experts=4",
       "model.moe.top_k=2", "model.moe.expert_ffn_dim=48", "model.moe.n_shared_experts=1",
       "model.moe.router=sigmoid_bias", "model.moe.bias_update_rate=0.01", "train.micro_batch=4",
       "train.grad_accum=2", f"train.steps={STEPS}", f"checkpoint.interval_steps={SAVE_AT}", "checkpoint.keep=2",
       "supervisor.max_restarts=0"]
LAYOUTS = {  # name: (ranks, overrides); every one a global batch of 16 sequences
    "ep1": (2, []),
    "ep2": (2, ["parallel.ep=2"]),
    "ep2tp2pp2": (8, ["parallel.ep=2", "parallel.tp=2", "parallel.pp=2"]),
}


def train(tmp: Path, cache: Path, name: str, nproc: int, *overrides: str) -> list[dict]:
    out = mshpc(*train_args(tmp, cache, *MOE, *overrides, name=name), "--nproc", str(nproc))
    assert out.returncode == 0, out.stderr[-3000:]
    return read_metrics(tmp / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_cache) -> tuple[Path, dict[str, list[dict]]]:
    tmp = tmp_path_factory.mktemp("moe")
    return tmp, {name: train(tmp, corpus_cache, name, n, *o) for name, (n, o) in LAYOUTS.items()}


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def test_expert_parallel_layouts_equal_ep1(runs):
    _, rows = runs
    ep1 = losses(rows["ep1"])
    assert len(ep1) == STEPS and ep1[-1] < ep1[0]
    assert losses(rows["ep2"]) == pytest.approx(ep1, rel=1e-5)
    # tp splits the sequence: each tp rank routes its shard; the router's loss is the micro-batch's
    assert losses(rows["ep2tp2pp2"]) == pytest.approx(ep1, rel=2e-4)


def test_metrics_count_every_token_copy_once_per_layer(runs):
    _, rows = runs
    copies = 16 * 32 * 2  # global batch x seq_len x top_k
    for row in rows["ep2tp2pp2"] + rows["ep2"]:
        for layer in (0, 1):
            assert sum(row[f"moe_tokens_per_expert/layer{layer}"]) == copies
        assert row["moe_dropped"] == 0 and row["moe_load_max_mean"] >= 1.0
        assert row["moe_aux_loss"] > 0 and row["moe_z_loss"] > 0


def resume(tmp: Path, cache: Path, name: str, nproc: int, *overrides: str) -> list[dict]:
    """Train `name` from ep2's step-16 checkpoint (copied into its own run directory)."""
    root = tmp / name / "checkpoints"
    root.mkdir(parents=True)
    shutil.copytree(tmp / "ep2" / "checkpoints" / f"step-{SAVE_AT:07d}", root / f"step-{SAVE_AT:07d}")
    (root / "latest").symlink_to(f"step-{SAVE_AT:07d}")
    return train(tmp, cache, name, nproc, *overrides)


def final_weights(run_dir: Path) -> dict[str, bytes]:
    out = {}
    for shard in sorted((run_dir / "checkpoints" / f"step-{STEPS:07d}").glob("shard-*.h5")):
        with h5py.File(shard, "r") as f:
            out.update({f"{shard.name}/{n}": d[()].tobytes() for n, d in f["master"].items()})
    return out


def test_resume_at_ep2_is_bitwise_and_at_ep1_and_ep4_equal(runs, corpus_cache):
    tmp, rows = runs
    after = losses(rows["ep2"])[SAVE_AT:]
    same = resume(tmp, corpus_cache, "again", 2, *LAYOUTS["ep2"][1])
    assert losses(same) == after  # bitwise: the masters, moments, router biases and RNG restored
    assert final_weights(tmp / "again") == final_weights(tmp / "ep2")
    ep1 = resume(tmp, corpus_cache, "to_ep1", 2)
    assert losses(ep1) == pytest.approx(after, rel=1e-5)
    # 4 ranks, one micro-batch each: the same micro-batches (the router's loss is per micro-batch)
    ep4 = resume(tmp, corpus_cache, "to_ep4", 4, "parallel.ep=4", "train.grad_accum=1")
    assert losses(ep4) == pytest.approx(after, rel=1e-5)


def test_ckpt_tools_see_experts_by_global_index(runs):
    tmp, _ = runs
    folder = tmp / "ep2" / "checkpoints" / f"step-{STEPS:07d}"
    listing = inspect(folder, tensors=True)
    # each ep rank wrote its 2 experts of 4 into the whole tensor
    assert "model/layers.0.mlp.experts.fc  [4, 96, 64] float32  2 slice(s)" in listing
    assert "master/layers.0.mlp.experts.proj  [4, 64, 48] float32  2 slice(s)" in listing
    assert "buffer/layers.1.mlp.router.expert_bias  [4] float32  1 slice(s)" in listing
    assert verify(folder)[1] == []
    shutil.copytree(folder, tmp / "broken")
    for shard in sorted((tmp / "broken").glob("shard-*.h5")):
        with h5py.File(shard, "r+") as f:
            data = f["master"]["layers.0.mlp.experts.fc"]
            data[0] = data[0] + 1.0
            break
    good, bad = verify(tmp / "broken")
    assert good == [] and "layers.0.mlp.experts.fc" in bad[0]
