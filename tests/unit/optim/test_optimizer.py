"""build_optimizer: the named optimizer, nanoGPT's decay groups, tied weights once."""

import dataclasses

import pytest
import torch

from mshpc.config import ModelConfig, OptimConfig
from mshpc.errors import ConfigError
from mshpc.model.gpt import GPT
from mshpc.optim.lamb import Lamb
from mshpc.optim.optimizer import build_optimizer

MODEL = ModelConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16, norm="layernorm")


@pytest.mark.parametrize("name,cls", [("adamw", torch.optim.AdamW), ("lamb", Lamb)])
def test_groups_and_hyperparameters(name, cls):
    model = GPT(MODEL)
    cfg = OptimConfig(name=name, lr=1e-3, weight_decay=0.05, beta1=0.8, beta2=0.9, eps=1e-7)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, cls)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert len(no_decay["params"]) == 2 * (2 * MODEL.n_layer + 1)  # LayerNorm weight and bias
    flat = [p for g in opt.param_groups for p in g["params"]]
    assert len({id(p) for p in flat}) == len(flat) == len(list(model.parameters()))
    assert sum(p.numel() for p in flat) == model.num_params()  # the tied weight once
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-7 and decay["lr"] == 1e-3


def test_unknown_name_lists_choices():
    bad = dataclasses.replace(OptimConfig(), name="sgd")
    with pytest.raises(ConfigError, match="'adamw' or 'lamb'"):
        build_optimizer(GPT(MODEL), bad)
