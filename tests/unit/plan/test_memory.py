"""The memory formulas against values worked by hand for configs/gpt-175b.yaml:
h = 12288, a = 96, s = 2048, L = 96, V = 64000, MLP 4h, parallel block, LayerNorm (weight and
bias), tied embeddings, no dropout."""

import dataclasses

import pytest

from mshpc.config import load_config
from mshpc.model.gpt import GPT
from mshpc.plan.layout import Layout
from mshpc.plan.memory import (
    in_flight_layers, korthikanti_layer_bytes, layer_activation_bytes, layer_activation_terms, layer_params, memory,
    stage_activation_bytes, stage_params,
)
from support.cli_runner import REPO

CFG = load_config(REPO / "configs/gpt-175b.yaml")
M = CFG.model
SBH = 2048 * 1 * 12288  # s * b * h = 25,165,824
# mshpc's parallel block per token and tp rank, bf16 autocast, in bytes: fp32 norm input 4h and
# rstd 4, the shared input's bf16 shard 2h, rotated q and k 4h, v 2h (a copy: no view pins the
# qkv output), attention output 2h and logsumexp 4a, fc output 8h, GeLU output 8h: 30h + 4 + 4a
LAYER = (30 * 12288 + 4 + 4 * 96) * 2048 / 8  # 2048 tokens of one micro-batch on 1/8 of them


def layout(**kw):
    base = dict(dp=4, tp=8, pp=8, virtual_stages=1, micro_batch=1, n_micro=192, checkpointing="none")
    return Layout(**{**base, **kw})


def test_layer_and_stage_parameters_175b():
    # 12 h^2 = 1,811,939,328 matrix weights split 8 ways, plus one replicated LayerNorm of 2h
    assert layer_params(M, tp=8) == 1_811_939_328 / 8 + 24_576
    # 12 layers per stage + the vocab-parallel embedding 64000 * 12288 / 8 = 98,304,000
    assert stage_params(M, layout(), 0) == 12 * 226_516_992 + 98_304_000
    # the last stage: 12 layers, the final norm, and its copy of the tied lm head
    assert stage_params(M, layout(), 7) == 12 * 226_516_992 + 24_576 + 98_304_000


def test_llama3_parameters_match_the_published_counts():
    # Meta's counts: 8.03B and 70.6B. 8B by hand: per block q, out 2 * 4096^2 = 33,554,432; k, v
    # 2 * 4096 * 1024 = 8,388,608; SwiGLU 3 * 4096 * 14336 = 176,160,768; two RMSNorms 8,192:
    # 218,112,000 x 32 = 6,979,584,000; untied embedding and lm head 2 * 128256 * 4096 =
    # 1,050,673,152; final norm 4,096: 8,030,261,248
    one = Layout(1, 1, 1, 1, 1, 1, "none")
    m8 = load_config(REPO / "configs/llama3-8b.yaml").model
    assert stage_params(m8, one, 0) == 8_030_261_248
    # 70B: block 2 * 8192^2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192 = 855,654,400 x 80
    # = 68,452,352,000; 2 * 128256 * 8192 = 2,101,346,304; final norm 8,192: 70,553,706,496
    m70 = load_config(REPO / "configs/llama3-70b.yaml").model
    assert stage_params(m70, one, 0) == 70_553_706_496
    assert round(stage_params(m8, one, 0) / 1e9, 2) == 8.03 and round(stage_params(m70, one, 0) / 1e9, 1) == 70.6


def test_gqa_kv_heads_split_over_tp_or_replicated():
    """8 kv heads of 128 at d 8192: tp 8 splits them (one per rank); tp 16 cannot, so each rank
    keeps one whole kv head (2 * 8192 * 128 weights) as Megatron replicates them."""
    m = load_config(REPO / "configs/llama3-70b.yaml").model
    norms, kv_head = 2 * 8192, 2 * 8192 * 128
    rest = 2 * 8192**2 + 3 * 8192 * 28672  # q, out and the MLP: split over any tp
    assert layer_params(m, tp=8) == rest / 8 + kv_head + norms
    assert layer_params(m, tp=16) == rest / 16 + kv_head + norms


def test_weights_grads_and_zero_sharded_state_175b():
    mem = memory(M, layout(dp=4))
    # the first stage is the fuller: its 96 layers' worth of in-flight activations outweigh
    # the last stage's 12 plus logits
    params = 12 * 226_516_992 + 98_304_000
    assert mem.stage == 0
    assert mem.activations == 96 * LAYER
    assert mem.weights == 4 * params and mem.grads == 4 * params
    assert mem.optimizer == 12 * params / 4  # fp32 master + two moments over dp = 4


def test_korthikanti_equation_2_for_the_gpt3_block():
    # Korthikanti et al. 2022 eq. 2 with t = 8, serial block with dropout, scores stored:
    # sbh (34/t + 5as/(ht)) = 25,165,824 * (4.25 + 5 * 96 * 2048 / 98,304) = 25,165,824 * 14.25
    assert korthikanti_layer_bytes(M, layout()) == 358_612_992
    # selective recomputation drops the 5as^2b score terms: sbh * 34 / t
    assert korthikanti_layer_bytes(M, layout(checkpointing="selective")) == SBH * 34 / 8


def test_mshpc_parallel_block_activations():
    # SDPA's fused attention stores no s x s scores; no dropout, so no masks
    terms = layer_activation_terms(M, layout())
    assert terms["values"] == 2 * SBH / 8 and terms["norm_inputs"] == 4 * SBH / 8
    assert terms["attention_scores"] == terms["dropout_masks"] == terms["attention_mask"] == 0
    assert layer_activation_bytes(M, layout()) == sum(terms.values()) == LAYER


def test_serial_block_with_dropout_and_stored_scores():
    serial = dataclasses.replace(M, parallel_block=False, dropout=0.1)
    # a second norm (4h + 4) and a second GEMM input shard (2h), two 1-byte dropout masks, and
    # the 5as^2b scores of unfused attention
    want = LAYER + (6 * 12288 + 4 + 2) * 2048 / 8 + 5 * 96 * 2048 * 2048 / 8
    assert layer_activation_bytes(serial, layout(), flash=False) == want


def test_gqa_and_swiglu_terms_follow_their_definitions():
    m = dataclasses.replace(M, n_kv_head=8, mlp="swiglu", ffn_dim=32768)
    terms = layer_activation_terms(m, layout(tp=1))
    hd = 12288 // 96
    assert terms["values"] == 2 * 8 * hd * 2048  # smaller k and v
    assert terms["rotated_q_k"] == 2 * (96 + 8) * hd * 2048
    # tp 16 over 8 kv heads: each rank keeps one whole kv head of all 2048 tokens
    copied = layer_activation_terms(m, layout(tp=16))
    assert copied["values"] == 2 * hd * 2048 and copied["rotated_q_k"] == 2 * (96 / 16 + 1) * hd * 2048
    assert terms["fc_output"] == 2 * 2 * 32768 * 2048  # [gate | up]
    assert terms["activation_output"] == 2 * 32768 * 2048


def test_pipeline_in_flight_activations():
    # 1F1B: stage 0 holds p = 8 micro-batches of its 12 layers = L = 96 layers' worth
    assert in_flight_layers(M, layout(), 0) == 96
    assert in_flight_layers(M, layout(), 7) == 12
    # fewer micro-batches than stages: only those are in flight
    assert in_flight_layers(M, layout(n_micro=2), 0) == 24
    # GPipe: every micro-batch's forward before any backward, on every stage
    assert in_flight_layers(M, layout(), 0, "gpipe") == 192 * 12
    # interleaved, v = 2: 2(p-1) + (v-1)p + 1 = 23 chunks of 6 layers = L (1 + (p-1)/(pv)) = 138
    assert in_flight_layers(M, layout(virtual_stages=2), 0) == 96 * (1 + 7 / 16) == 138


def test_full_recomputation_keeps_layer_inputs():
    full = layout(checkpointing="full")
    # stage 0: 96 layers' worth of inputs (the fp32 residual, 4 sbh / t each) plus the one layer
    # being recomputed
    assert stage_activation_bytes(M, full, 0) == 96 * 4 * SBH / 8 + LAYER
    # stage 7: 12 layers' inputs, one layer, and the output layer: fp32 norm input 4 sbh and the
    # logits, bf16 out of the lm head and the fp32 log-softmax: (4 sbh + 6 s b V) / t
    assert stage_activation_bytes(M, full, 7) == (12 * 4 * SBH + 4 * SBH + 6 * 2048 * 64000) / 8 + LAYER


def test_parameter_count_matches_the_model():
    cfg = load_config(REPO / "configs/tiny.yaml", ["model.tie_embeddings=false", "model.norm=layernorm"])
    model = GPT(cfg.model)
    one = Layout(1, 1, 1, 1, 1, 1, "none")
    assert stage_params(cfg.model, one, 0) == model.num_params()
    tied = load_config(REPO / "configs/tiny.yaml")
    assert stage_params(tied.model, one, 0) == GPT(tied.model).num_params()
    # split over 2 stages, the tied lm head is held twice (once per end of the pipeline)
    two = Layout(1, 1, 2, 1, 1, 2, "none")
    total = stage_params(tied.model, two, 0) + stage_params(tied.model, two, 1)
    assert total == GPT(tied.model).num_params() + tied.model.vocab_size * tied.model.d_model
    # SwiGLU's three matrices of model.ffn_dim
    swiglu = load_config(REPO / "configs/tiny.yaml", ["model.mlp=swiglu", "model.ffn_dim=344"]).model
    assert stage_params(swiglu, one, 0) == GPT(swiglu).num_params()


def test_the_3072_gpu_layouts_of_the_175b_table():
    # docs/planning.md's 175B table at 6,144 sequences: the layout it used to pick (dp 96, tp 8, pp 4, v 24,
    # mb 4) needed 83.4 GiB on its first stage while v pinned the qkv output, and fits in 80 with
    # v copied out; the plan's pick now needs 65.9 GiB
    old = Layout(dp=96, tp=8, pp=4, virtual_stages=24, micro_batch=4, n_micro=16, checkpointing="none")
    new = Layout(dp=64, tp=8, pp=6, virtual_stages=16, micro_batch=4, n_micro=24, checkpointing="none")
    assert memory(M, old).total / 2**30 == pytest.approx(78.7, abs=0.05)
    assert memory(M, new).total / 2**30 == pytest.approx(65.9, abs=0.05)
