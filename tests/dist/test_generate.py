"""`mshpc generate` on a checkpoint saved at tp=2 x pp=2 (4 ranks, multi-query attention: each
tp rank saved a copy of the kv head): the one-process model holds the whole weights, joined from
the tp parts of both stages, and the command prints the prompt and its continuation."""

import numpy as np
import pytest
import torch

from mshpc.checkpoint.paths import latest_step, step_dir
from mshpc.config import load_config
from mshpc.generate import SampleOptions, decode, load_model
from support.ckpt_runs import final_params
from support.cli_runner import mshpc


@pytest.fixture(scope="module")
def run_dir(mqa_tp2_pp2):
    return mqa_tp2_pp2  # conftest.py: 8 steps at tp=2 x pp=2, multi-query, checkpoints at 4 and 8


def joined_by_hand(parts: dict[str, np.ndarray], name: str) -> np.ndarray:
    """The whole weight from the tp=2 parts: rows or columns in rank order; qkv's q heads in
    rank order, then the one kv head's k and v rows once (both ranks hold a copy)."""
    if name in parts:
        return parts[name]  # norms: whole on both tp ranks, saved once
    p0, p1 = parts[f"{name}@tp0"], parts[f"{name}@tp1"]
    if name.endswith("attn.qkv.weight"):
        q = p0.shape[0] - 2 * 16  # each rank's q rows: its 2 heads of 16
        return np.concatenate([p0[:q], p1[:q], p0[q:]])
    return np.concatenate([p0, p1], axis=1 if name.endswith("proj.weight") else 0)


def test_a_tp2_pp2_checkpoint_loads_whole_and_generates(run_dir):
    folder = step_dir(run_dir / "checkpoints", latest_step(run_dir / "checkpoints"))
    model = load_model(folder, load_config(run_dir / "config.yaml").model)
    parts = final_params(run_dir / "checkpoints")
    assert {n for n in parts if "@tp" in n} and model.layers["1"].attn.qkv.weight.shape == ((4 + 2) * 16, 64)
    for name, p in model.named_parameters():
        assert np.array_equal(p.detach().numpy(), joined_by_hand(parts, name)), name
    greedy = decode(model, list(b"def "), SampleOptions(max_new_tokens=12, greedy=True), stop_id=256)
    out = mshpc("generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "12", "--greedy")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "def " + bytes(t for t in greedy if t < 256).decode("utf-8", errors="replace") + "\n"
    assert "tokens/s" in out.stderr


def test_the_cache_is_what_full_recomputation_gives_on_trained_weights(run_dir):
    model = load_model(step_dir(run_dir / "checkpoints", 4), load_config(run_dir / "config.yaml").model)
    opts = SampleOptions(max_new_tokens=20, temperature=0.8, top_k=20, seed=3)
    torch.manual_seed(0)
    assert decode(model, list(b"import "), opts) == decode(model, list(b"import "), opts, cache=False)
