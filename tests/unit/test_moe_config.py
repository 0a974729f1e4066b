"""A mixture of experts' config: the optional `model.moe` section (absent = dense) built, set and
reloaded like any section, and what cannot train stopped by one line (the CLI exits 2 before any
rank starts): ep not dividing the experts or the ranks, top_k above n_experts, a layout that
cannot hold the model."""

from __future__ import annotations

import pytest
from support.cli_runner import REPO, mshpc

from mshpc.config import dump_yaml, from_dict, load_config, resolve_world
from mshpc.errors import ConfigError
from mshpc.plan.auto_layout import choose_layout
from mshpc.plan.devices import DEVICES

TINY_MOE = REPO / "configs/tiny-moe.yaml"


def test_the_moe_section_is_optional_and_set_like_any_other():
    assert load_config(REPO / "configs/tiny.yaml").model.moe is None  # absent: dense
    cfg = load_config(REPO / "configs/tiny.yaml", ["model.parallel_block=false", "model.moe.n_experts=4"])
    assert cfg.model.moe is not None and cfg.model.moe.n_experts == 4 and cfg.model.moe.top_k == 2
    assert load_config(TINY_MOE, ["model.moe=null"]).model.moe is None
    moe = load_config(TINY_MOE)
    import yaml

    assert from_dict(yaml.safe_load(dump_yaml(moe))) == moe  # the resolved config reloads to an equal one
    with pytest.raises(ConfigError, match=r"unknown config key 'model.moe.topk' \(did you mean 'top_k'\?"):
        load_config(TINY_MOE, ["model.moe.topk=1"])


@pytest.mark.parametrize("sets, words", [
    (["parallel.ep=3"], "parallel.ep=3 does not divide model.moe.n_experts=8 (choose 1, 2, 4 or 8)"),
    (["model.moe.top_k=9"], "model.moe.top_k=9 is above model.moe.n_experts=8 (choose 1 to 8)"),
    (["model.moe=null", "parallel.ep=2"], "parallel.ep=2 needs a mixture of experts"),
    (["model.parallel_block=true"], "model.moe with model.parallel_block=true is not available"),
    (["model.moe.first_dense_layers=4"], "leave no mixture-of-experts layer among model.n_layer=4"),
])
def test_what_cannot_train_is_one_line(sets, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_config(TINY_MOE, sets)


def test_ep_must_divide_the_data_parallel_ranks():
    cfg = load_config(TINY_MOE, ["parallel.ep=4"])
    assert resolve_world(cfg, 8).parallel.dp == 8
    with pytest.raises(ConfigError, match=r"world size 6 gives dp=6 .* which parallel.ep=4 does not divide "
                                          r"\(launch a multiple of tp\*pp\*ep=4 ranks\)"):
        resolve_world(cfg, 6)


def test_a_layout_that_cannot_hold_the_model_is_refused():
    """Qwen3-30B-A3B on 2 H100s: no layout, whatever its ep, holds 30B parameters' state."""
    qwen = load_config(REPO / "configs/qwen3-30b-a3b.yaml", ["train.grad_accum=2"])
    with pytest.raises(ConfigError, match="none of the .* layouts of 2 ranks .* fits in 72.0 of 80 GiB .*per rank"):
        choose_layout(2, DEVICES["h100"], 8, model_cfg=qwen.model, parallel=qwen.parallel, train=qwen.train,
                      optim=qwen.optim, plan_cfg=qwen.plan)


@pytest.mark.parametrize("args, words", [
    (["--set", "parallel.ep=3"], "parallel.ep=3 does not divide model.moe.n_experts=8"),
    (["--set", "parallel.ep=4", "--nproc", "6"], "world size 6 gives dp=6"),
    (["--set", "model.moe.top_k=9"], "model.moe.top_k=9 is above model.moe.n_experts=8"),
])
def test_the_cli_says_it_in_one_line_and_exits_2(args, words, tmp_path):
    out = mshpc("train", str(TINY_MOE), "--set", f"run.out_dir={tmp_path}", *args, timeout_s=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-2000:])
    assert lines[0].startswith("mshpc: error: ConfigError: ") and words in lines[0]
    assert not (tmp_path / "tiny-moe").exists()  # no rank started
