"""Whether a config may resume a checkpoint (checkpoint/compat.py): another model is refused in one
line naming each differing field, another run in a shared checkpoint.dir too (issue #43, finding
7); settings that move no weight are only named. The multi-rank path is tests/dist/test_first_hour.py."""

from pathlib import Path

import pytest

from mshpc.checkpoint.compat import (
    CONFIG_KEY,
    ResumeMismatchError,
    check_resume,
    check_weight_names,
    other_run_on_fresh_start,
)
from mshpc.config import config_hash, load_config, to_dict
from mshpc.errors import ConfigError

FOLDER = Path("runs/a/checkpoints/step-0000010")
SAVED = load_config(None, ["run.name=a", "model.n_layer=4"])


def resume(cfg, saved=SAVED):
    return check_resume(FOLDER, config_hash(saved), {CONFIG_KEY: to_dict(saved)}, config_hash=config_hash(cfg),
                        config_record=to_dict(cfg), model_cfg=cfg.model)


def test_the_same_config_resumes_and_changed_settings_are_named():
    assert resume(SAVED) == []
    longer = load_config(None, ["run.name=a", "model.n_layer=4", "train.steps=200", "optim.lr=1e-4",
                                "model.seq_len=512"])  # a longer context moves no weight
    assert resume(longer) == ["model.seq_len: 256 -> 512", "optim.lr: 0.0003 -> 0.0001", "train.steps: 100 -> 200"]


def test_another_model_is_refused_naming_each_field_and_how_to_start_fresh():
    other = load_config(None, ["run.name=a", "model.n_layer=2", "model.d_model=128", "model.n_kv_head=2"])
    with pytest.raises(ResumeMismatchError) as err:
        resume(other)
    assert str(err.value) == (
        f"train.resume: checkpoint {FOLDER} holds another model (model.n_layer=4 there, 2 here; model.n_kv_head=4 "
        "there, 2 here; model.d_model=256 there, 128 here; model.ffn_dim=1024 there, 512 here); loading it would drop or misplace weights: start fresh "
        "with --set train.resume=never or a new run.name, or resume step-0000010 with its own settings")
    assert isinstance(err.value, ConfigError)  # a user error: exit 2, never retried or blamed on a node


def test_finding7_another_runs_checkpoint_in_a_shared_dir_is_refused():
    mine = load_config(None, ["run.name=b", "model.n_layer=4", "checkpoint.dir=/shared/ckpt", "optim.lr=1e-3"])
    with pytest.raises(ResumeMismatchError) as err:
        resume(mine)
    assert str(err.value).startswith(
        "train.resume: checkpoint.dir=/shared/ckpt holds run 'a''s checkpoints (step-0000010; this config differs "
        "in checkpoint.dir: None -> /shared/ckpt; optim.lr: 0.0003 -> 0.001; run.name: a -> b); give this run its "
        "own checkpoint.dir, or start from it on purpose with --set train.resume=")
    # its own run's checkpoint in the same shared dir resumes; a fresh start there is refused
    assert resume(load_config(None, ["run.name=a", "model.n_layer=4", "checkpoint.dir=/shared/ckpt"]))
    refusal = other_run_on_fresh_start(FOLDER, {CONFIG_KEY: to_dict(SAVED)}, config_record=to_dict(mine))
    assert refusal is not None and "which this run's saves would prune" in str(refusal)
    assert other_run_on_fresh_start(FOLDER, {CONFIG_KEY: to_dict(SAVED)}, config_record=to_dict(SAVED)) is None


def test_a_checkpoint_that_keeps_no_config_is_judged_by_its_weights_names():
    names = {"tok_embeddings.weight", "layers.0.attn.qkv.weight", "layers.1.attn.qkv.weight"}
    saved = ["master/tok_embeddings.weight", "master/layers.0.attn.qkv.weight@tp1", "optim.exp_avg/x",
             "master/layers.3.attn.qkv.weight"]
    with pytest.raises(ResumeMismatchError, match=r"holds weights this config's model has no place for \(1, e.g. "
                                                  r"'layers.3.attn.qkv.weight'; model.n_layer=2"):
        check_weight_names(FOLDER, saved, load_config(None, ["model.n_layer=2"]).model, names)
    check_weight_names(FOLDER, saved[:3], load_config(None, ["model.n_layer=2"]).model, names)
    assert check_resume(FOLDER, "0" * 16, {}, config_hash=config_hash(SAVED), config_record=to_dict(SAVED),
                        model_cfg=SAVED.model) == []  # nothing to compare with
