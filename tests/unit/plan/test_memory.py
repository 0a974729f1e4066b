"""The memory formulas against values worked by hand for configs/gpt-175b.yaml:
h = 12288, a = 96, s = 2048, L = 96, V = 64000, MLP 4h, parallel block, RMSNorm, tied
embeddings, no dropout."""

import dataclasses


from mshpc.config import load_config
from mshpc.model.gpt import GPT
from mshpc.plan.layout import Layout
from mshpc.plan.memory import (
    in_flight_layers, layer_activation_bytes, layer_params, memory, stage_activation_bytes, stage_params,
)
from support.cli_runner import REPO

CFG = load_config(REPO / "configs/gpt-175b.yaml")
M = CFG.model
SBH = 2048 * 1 * 12288  # s * b * h = 25,165,824


def layout(**kw):
    base = dict(dp=4, tp=8, pp=8, virtual_stages=1, micro_batch=1, n_micro=192, checkpointing="none")
    return Layout(**{**base, **kw})


def test_layer_and_stage_parameters_175b():
    # 12 h^2 = 1,811,939,328 matrix weights split 8 ways, plus one replicated RMSNorm of h
    assert layer_params(M, tp=8) == 1_811_939_328 / 8 + 12_288
    # 12 layers per stage + the vocab-parallel embedding 64000 * 12288 / 8 = 98,304,000
    assert stage_params(M, layout(), 0) == 12 * 226_504_704 + 98_304_000
    # the last stage: 12 layers, the final norm, and its copy of the tied lm head
    assert stage_params(M, layout(), 7) == 12 * 226_504_704 + 12_288 + 98_304_000


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
    params = 12 * 226_504_704 + 98_304_000
    assert mem.stage == 0
    assert mem.activations == 96 * SBH * 28 / 8
    assert mem.weights == 4 * params and mem.grads == 4 * params
    assert mem.optimizer == 12 * params / 4  # fp32 master + two moments over dp = 4


def test_korthikanti_equation_2_for_the_gpt3_block():
    # Korthikanti et al. 2022 eq. 2 with t = 8, serial block with dropout, scores stored:
    # sbh (34/t + 5as/(ht)) = 25,165,824 * (4.25 + 5 * 96 * 2048 / 98,304) = 25,165,824 * 14.25
    serial = dataclasses.replace(M, parallel_block=False, dropout=0.1)
    assert layer_activation_bytes(serial, layout(), flash=False) == 358_612_992
    # selective recomputation drops the 5as^2b score terms: sbh * 34 / t
    assert layer_activation_bytes(serial, layout(checkpointing="selective"), flash=False) == SBH * 34 / 8


def test_mshpc_parallel_block_activations():
    # no dropout masks (-2), one norm (-2), one shared normed input (-2): 28 sbh / t; SDPA's
    # fused attention stores no s x s scores
    assert layer_activation_bytes(M, layout()) == SBH * 28 / 8 == 88_080_384


def test_pipeline_in_flight_activations():
    # 1F1B: stage 0 holds p = 8 micro-batches of its 12 layers = L = 96 layers' worth
    assert in_flight_layers(M, layout(), 0) == 96
    assert in_flight_layers(M, layout(), 7) == 12
    # fewer micro-batches than stages: only those are in flight
    assert in_flight_layers(M, layout(n_micro=2), 0) == 24
    # interleaved, v = 2: 2(p-1) + (v-1)p + 1 = 23 chunks of 6 layers = L (1 + (p-1)/(pv)) = 138
    assert in_flight_layers(M, layout(virtual_stages=2), 0) == 96 * (1 + 7 / 16) == 138


def test_full_recomputation_keeps_layer_inputs():
    full = layout(checkpointing="full")
    # stage 0: 96 layers' worth of inputs (2 sbh / t each) plus the one layer being recomputed
    assert stage_activation_bytes(M, full, 0) == 96 * 2 * SBH / 8 + SBH * 28 / 8
    # stage 7: 12 layers' inputs, one layer, and the output layer: norm input 2 sbh and the
    # logits, bf16 out of the lm head and the fp32 log-softmax: (2 sbh + 6 s b V) / t
    assert stage_activation_bytes(M, full, 7) == (12 * 2 * SBH + SBH * 28 + 2 * SBH + 6 * 2048 * 64000) / 8


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
