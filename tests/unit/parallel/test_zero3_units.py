"""ZeRO stage 3 without ranks: how a model is cut into units and uses (parallel/zero3.py), what
its config refuses, and what the plan counts for it (plan/memory.py, plan/steptime.py)."""

import dataclasses
import subprocess
import sys

import pytest
import torch
from support.cli_runner import REPO

from mshpc.config import ModelConfig, MoEConfig, global_batch, load_config
from mshpc.errors import ConfigError
from mshpc.model.gpt import GPT
from mshpc.parallel.zero3 import block_units, build_units
from mshpc.plan.devices import DEVICES
from mshpc.plan.layout import Layout, enumerate_layouts
from mshpc.plan.memory import GIB, memory, stage_params, stage_units, zero3_param_bytes
from mshpc.plan.report import plan
from mshpc.plan.steptime import dp_bytes

# RMSNorm: one weight per norm (the default LayerNorm adds a bias)
TINY = ModelConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32, norm="rmsnorm")
# dense layers 0, 1 and 3, a mixture of experts at 2 (a router, 4 experts, a gated shared expert)
TINY_MOE = dataclasses.replace(TINY, mlp="swiglu", norm="rmsnorm", parallel_block=False, tie_embeddings=False,
                               moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=24, n_shared_experts=1,
                                             shared_expert_gate=True, first_dense_layers=1, every=2))


def units_of(cfg: ModelConfig, per_unit: int = 1) -> tuple[GPT, list[list[str]], list]:
    with torch.device("meta"):
        model = GPT(cfg)
    named = list(model.named_parameters())
    blocks = block_units([(int(i), b) for i, b in model.layers.items()], per_unit)
    units, uses = build_units(model, named, blocks)
    return model, [[named[i][0] for i in unit] for unit in units], uses


def test_tied_embedding_is_one_unit_used_first_and_last():
    model, units, uses = units_of(TINY)
    assert units[0] == ["tok_embeddings.weight", "norm.weight"]  # the lm head is the embedding
    assert [len(u) for u in units[1:]] == [len(list(model.layers["0"].parameters()))] * 4
    assert [u.unit for u in uses] == [0, 1, 2, 3, 4, 0]
    assert uses[0].modules == (model.tok_embeddings,) and uses[-1].modules == (model.norm, model.lm_head)
    # an embedding's backward reads the token ids, not the weight: no gather for it
    assert [u.backward for u in uses] == [False, True, True, True, True, True]


def test_untied_parts_before_and_after_the_blocks_are_units_of_their_own():
    _, units, uses = units_of(dataclasses.replace(TINY, tie_embeddings=False), per_unit=3)
    assert units[0] == ["tok_embeddings.weight"] and units[-1] == ["norm.weight", "lm_head.weight"]
    assert len(units) == 4  # blocks 0-2, block 3
    assert [u.unit for u in uses] == [0, 1, 2, 3]


def test_block_units_never_span_a_gap_in_layer_indices():
    blocks = [(i, torch.nn.Linear(1, 1)) for i in (0, 1, 2, 6, 7, 8)]  # two pipeline chunks of one rank
    groups = block_units(blocks, 2)
    assert [len(g) for g in groups] == [2, 1, 2, 1]


BAD = [
    (["parallel.zero3_blocks_per_unit=2"], "parallel.zero3_blocks_per_unit=2 applies to ZeRO stage 3 only "
                                           "(set parallel.zero_stage=3"),
    (["parallel.reshard_after_forward=false"], "parallel.reshard_after_forward=False applies to ZeRO stage 3 only"),
    (["parallel.zero_stage=1"], "parallel.zero_stage=1 is not a valid choice (choose 2 or 3)"),
    (["parallel.zero_stage=3", "parallel.zero3_blocks_per_unit=5"],
     "parallel.zero3_blocks_per_unit=5 exceeds the 4 blocks of a pipeline chunk (choose 1 to 4)"),
    (["parallel.zero_stage=3", "parallel.pp=2", "parallel.zero3_blocks_per_unit=3"],
     "exceeds the 2 blocks of a pipeline chunk"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_combination_stage3_cannot_run_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/tiny.yaml", overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_cli_exits_2_on_it():
    out = subprocess.run([sys.executable, "-m", "mshpc", "train", str(REPO / "configs/tiny.yaml"), "--set",
                          "parallel.reshard_after_forward=false"], capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "applies to ZeRO stage 3 only" in lines[0]


# ---------------------------------------------------------------- the plan

GPT_125M = load_config(REPO / "configs/gpt-125m.yaml")
LLAMA_8B = load_config(REPO / "configs/llama3-8b.yaml")


def test_units_in_the_plan_are_the_engines():
    for cfg in (TINY, dataclasses.replace(TINY, tie_embeddings=False), TINY_MOE):
        model, units, uses = units_of(cfg)
        sizes = {i: sum(model.get_parameter(n).numel() for n in unit) for i, unit in enumerate(units)}
        lay = Layout(2, 1, 1, 1, 1, 1, "none", zero_stage=3)
        assert stage_units(cfg, lay, 0) == [sizes[u.unit] for u in uses]


def test_stage3_keeps_shards_and_two_neighbouring_units():
    m = GPT_125M.model
    lay = Layout(2, 1, 1, 1, 1, 1, "none", zero_stage=3)
    norm = 2 * m.d_model if m.norm == "layernorm" else m.d_model  # a weight, and LayerNorm's bias
    table, block = m.vocab_size * m.d_model + norm, 12 * m.d_model**2 + 2 * norm
    assert zero3_param_bytes(m, lay) == 4 * stage_params(m, lay, 0) / 2 + 4 * (table + block)
    two = memory(m, dataclasses.replace(lay, zero_stage=2))
    three = memory(m, lay)
    assert three.weights == 4 * (table + block) < two.weights / 2
    assert three.optimizer == two.optimizer
    # with the weights kept from forward to backward: every weight at the end of forward
    assert memory(m, lay, reshard=False).weights == two.weights


def test_stage3_carries_one_and_a_half_times_stage2s_bytes_per_micro_batch():
    lay = Layout(2, 1, 1, 1, 1, 1, "none")

    def carried(layout: Layout) -> float:
        return dp_bytes(layout, model_cfg=GPT_125M.model, parallel=GPT_125M.parallel)

    assert carried(dataclasses.replace(lay, zero_stage=3)) == 1.5 * carried(lay)
    # a gather pair per micro-batch: stage 2's bytes (a reduce-scatter, a gather) times (1 + 2 * 4) / 2
    assert carried(dataclasses.replace(lay, n_micro=4, zero_stage=3)) == (1 + 2 * 4) / 2 * carried(lay)


def test_plan_weighs_both_stages_and_stage3_fits_where_stage2_cannot():
    parallel = dataclasses.replace(LLAMA_8B.parallel, dp=8, tp=1)
    layouts = enumerate_layouts(8, 8, model_cfg=LLAMA_8B.model, global_batch=global_batch(LLAMA_8B.train, parallel))
    assert {lay.zero_stage for lay in layouts} == {2, 3}
    rows = plan(8, DEVICES["h100"], 8, model_cfg=LLAMA_8B.model, parallel=parallel, train=LLAMA_8B.train,
                plan_cfg=LLAMA_8B.plan)
    fit = {(p.layout.tp, p.layout.pp, p.layout.zero_stage) for p in rows if p.fits}
    # Llama 3 8B on one node of 8 H100s, data parallel only: stage 2 holds 16 bytes a weight
    # whole (128 GiB), stage 3 its shards and two layers
    assert (1, 1, 3) in fit and (1, 1, 2) not in fit
    assert min(p.memory.total for p in rows if p.layout.zero_stage == 2 and p.layout.tp == 1
               and p.layout.pp == 1) > 80 * GIB
