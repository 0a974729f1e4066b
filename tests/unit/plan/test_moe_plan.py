"""The plan of a mixture of experts: Mixtral 8x7B's and Qwen3-30B-A3B's parameters (all, and
active per token) and FLOPs per token worked out by hand from their published shapes; each GPU's
local experts under ep; the all-to-all in the step time; layouts with ep, and the automatic
layout choosing one."""

from __future__ import annotations

import dataclasses

import pytest
from support.cli_runner import REPO

from mshpc.config import load_config
from mshpc.diagnose.mfu import flops_per_token
from mshpc.plan.auto_layout import choose_layout
from mshpc.plan.devices import DEVICES
from mshpc.plan.layout import Layout, enumerate_layouts
from mshpc.plan.memory import GIB, memory, stage_expert_params
from mshpc.plan.moe_plan import all_to_all_bytes, model_params
from mshpc.plan.report import describe_model, plan
from mshpc.plan.steptime import step_time

MIXTRAL = load_config(REPO / "configs/mixtral-8x7b.yaml")
QWEN3 = load_config(REPO / "configs/qwen3-30b-a3b.yaml")


def test_mixtral_8x7b_by_hand():
    d, layers, vocab, ffn, seq = 4096, 32, 32000, 14336, 4096
    attention = 2 * d * d + 2 * d * 8 * 128  # q and o, k and v of 8 kv heads of 128
    expert = 3 * d * ffn
    router, norms = 8 * d, 2 * d
    total = 2 * vocab * d + layers * (attention + 8 * expert + router + norms) + d
    active = 2 * vocab * d + layers * (attention + 2 * expert + router + norms) + d
    m = MIXTRAL.model
    assert model_params(m) == total and model_params(m, active=True) == active
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9  # Mixtral's paper and model card
    # training FLOPs: 6 per active matrix weight, attention's 12 s h per layer, the logits' 6 h V
    per_token = 6 * layers * (attention + 2 * expert + router) + 12 * layers * seq * d + 6 * d * vocab
    assert flops_per_token(m) == per_token


def test_qwen3_30b_a3b_by_hand():
    d, layers, vocab, ffn, seq, hd = 2048, 48, 151936, 768, 4096, 128
    attention = 2 * d * 32 * hd + 2 * d * 4 * hd  # heads of 128, wider than d / 32 = 64
    expert = 3 * d * ffn
    router, norms = 128 * d, 2 * d + 2 * hd  # and the per-head q and k norms
    total = 2 * vocab * d + layers * (attention + 128 * expert + router + norms) + d
    active = 2 * vocab * d + layers * (attention + 8 * expert + router + norms) + d
    m = QWEN3.model
    assert model_params(m) == total and model_params(m, active=True) == active
    assert round(total / 1e9, 1) == 30.5 and int(active / 1e8) == 33  # the model card: 30.5B, 3.3B (3.35B, truncated)
    per_token = 6 * layers * (attention + 8 * expert + router) + 12 * layers * seq * 32 * hd + 6 * d * vocab
    assert flops_per_token(m) == per_token
    assert describe_model(m).startswith("model: 30.53B parameters, 3.35B active per token (128 experts, top 8")


def test_local_experts_and_their_sharded_state():
    m = QWEN3.model
    one = Layout(dp=64, tp=1, pp=4, virtual_stages=1, micro_batch=1, n_micro=16, checkpointing="full", ep=1)
    eight = dataclasses.replace(one, ep=8)
    experts = 3 * 2048 * 768 * 48 // 4  # per expert, for the stage's 12 layers
    assert stage_expert_params(m, one) == 128 * experts and stage_expert_params(m, eight) == 16 * experts
    a, b = memory(m, one), memory(m, eight)
    assert a.weights - b.weights == pytest.approx((128 - 16) * experts * 4)
    # the experts' masters and moments over dp / ep = 8 ranks holding the same experts
    assert b.optimizer == pytest.approx(((b.weights / 4 - 16 * experts) / 64 + 16 * experts / 8) * 12)


def test_the_all_to_all_in_the_step_time():
    m = MIXTRAL.model
    lay = Layout(dp=64, tp=2, pp=8, virtual_stages=1, micro_batch=1, n_micro=16, checkpointing="none", ep=8)
    # b * s / tp tokens, 2 copies each, 7/8 of them to another GPU, in bf16
    assert all_to_all_bytes(m, lay, 2) == 4096 / 2 * 2 * 4096 * 2 * 7 / 8
    h100 = DEVICES["h100"]
    hidden = step_time(lay, h100, 8, model_cfg=m, parallel=MIXTRAL.parallel)
    exposed = step_time(lay, h100, 8, model_cfg=m, parallel=dataclasses.replace(MIXTRAL.parallel, ep_overlap=False))
    assert 0 < hidden.ep_s < exposed.ep_s  # tp * ep = 16 ranks span 2 nodes: the inter-node link
    assert step_time(dataclasses.replace(lay, ep=1), h100, 8, model_cfg=m, parallel=MIXTRAL.parallel).ep_s == 0


def test_layouts_take_every_ep_that_divides_dp_and_the_experts():
    eps = {lay.ep for lay in enumerate_layouts(64, 8, model_cfg=MIXTRAL.model, global_batch=64)}
    assert eps == {1, 2, 4, 8}
    dense = dataclasses.replace(MIXTRAL.model, moe=None)
    assert {lay.ep for lay in enumerate_layouts(64, 8, model_cfg=dense, global_batch=64)} == {1}


def test_qwen3_on_1024_h100s_fits_with_ep():
    predictions = plan(1024, DEVICES["h100"], 8, model_cfg=QWEN3.model, parallel=QWEN3.parallel, train=QWEN3.train,
                       plan_cfg=QWEN3.plan)
    fitting = [p for p in predictions if p.fits]
    assert fitting and fitting[0].layout.ep > 1
    assert all(p.memory.total <= 80 * GIB * (1 - QWEN3.plan.memory_headroom) for p in fitting)


def test_auto_layout_chooses_ep():
    """Qwen3's layers, 8 of them, on 16 H100s: all 128 experts on every GPU do not fit, so the
    automatic layout splits them."""
    m = dataclasses.replace(QWEN3.model, n_layer=8)
    parallel = dataclasses.replace(QWEN3.parallel, layout="auto", ep=1)
    train = dataclasses.replace(QWEN3.train, grad_accum=16)
    choice = choose_layout(16, DEVICES["h100"], 8, model_cfg=m, parallel=parallel, train=train, optim=QWEN3.optim,
                           plan_cfg=QWEN3.plan)
    assert choice.best.layout.ep > 1
    whole = dataclasses.replace(choice.best.layout, ep=1)
    assert memory(m, whole).total > memory(m, choice.best.layout).total
