"""What one block saves for backward, measured (mshpc/plan/saved_activations.py) on one rank,
against the plan's formula term by term (mshpc/plan/memory.py) and against Korthikanti et al.
2022's count for the same block. The 2- and 4-rank cases are in tests/dist/plan."""

import dataclasses

import pytest
import torch

from mshpc.config import ModelConfig
from mshpc.plan.layout import Layout
from mshpc.plan.memory import layer_activation_bytes, layer_input_bytes
from mshpc.plan.saved_activations import layer_bytes, measure

# s * b = 96 tokens, not d_model = 128: a (b * s, d) view cannot pass for a weight
M = ModelConfig(vocab_size=64, seq_len=48, n_layer=3, n_head=4, d_model=128, dropout=0.0)
B = 2
SBH = M.seq_len * B * M.d_model
# Korthikanti's count, in elements per s*b*h, without dropout masks or scores: serial = norm
# inputs 2, qkv input 1, q, k, v 3, attention output 1, MLP input 1, GeLU input 4, its output 4;
# parallel = one norm and one shared input
PAPER = {False: 16, True: 14}
BF16 = torch.bfloat16
CASES = [(pb, ck, docs, win, ac) for pb in (False, True) for ck in ("none", "selective", "full")
         for docs, win, ac in ((1, None, None), (1, None, BF16), (3, None, BF16), (1, 16, BF16))]
# SwiGLU (its kernel's input [gate | up] saved whole) and grouped-query / multi-query attention
# (k and v of n_kv_head heads), alone and as Llama has them; full recomputation keeps only the
# layer's input whatever the block, so it is not repeated here
VARIANTS = {"swiglu": dict(mlp="swiglu"), "gqa": dict(n_kv_head=2), "mqa": dict(n_kv_head=1),
            "llama": dict(mlp="swiglu", n_kv_head=2, norm="rmsnorm", ffn_dim=344)}
VARIANT_CASES = [(name, pb, ck, ac) for name in VARIANTS for pb in (False, True)
                 for ck, ac in (("none", None), ("none", BF16), ("selective", BF16))]


def formula(m, checkpointing, tp, documents, act_bytes):
    layout = Layout(dp=1, tp=tp, pp=1, virtual_stages=1, micro_batch=B, n_micro=1, checkpointing=checkpointing)
    if checkpointing == "full":
        return layer_input_bytes(m, layout)
    return layer_activation_bytes(m, layout, documents=documents, window_kernel=False, act_bytes=act_bytes)


@pytest.mark.parametrize("parallel_block,checkpointing,documents,window,autocast", CASES)
def test_formula_is_the_measured_bytes(parallel_block, checkpointing, documents, window, autocast):
    m = dataclasses.replace(M, parallel_block=parallel_block, sliding_window=window)
    got = layer_bytes(measure(m, checkpointing, B, documents=documents, autocast=autocast), M.n_layer)
    want = formula(m, checkpointing, 1, documents > 1, 2 if autocast else 4)
    assert got == pytest.approx(want, rel=0.05), (got / SBH, want / SBH)


@pytest.mark.parametrize("variant,parallel_block,checkpointing,autocast", VARIANT_CASES)
def test_formula_is_the_measured_bytes_for_swiglu_and_gqa(variant, parallel_block, checkpointing, autocast):
    m = dataclasses.replace(M, parallel_block=parallel_block, **VARIANTS[variant])
    got = layer_bytes(measure(m, checkpointing, B, autocast=autocast), M.n_layer)
    want = formula(m, checkpointing, 1, False, 2 if autocast else 4)
    assert got == pytest.approx(want, rel=0.05), (got / SBH, want / SBH)


def test_v_is_saved_without_the_qkv_output_it_came_from():
    # a view of v would pin the whole (b, s, nh + 2 nkv, hd) GEMM output: nothing saved is that wide
    for kv in (4, 2):
        m = dataclasses.replace(M, n_kv_head=kv)
        qkv_width = (M.n_head + 2 * kv) * (M.d_model // M.n_head)
        sizes = [nbytes for _, _, nbytes, _ in measure(m, "none", B).tensors[1]]
        assert 4 * B * M.seq_len * qkv_width not in sizes, (kv, sizes)
        assert 4 * B * M.seq_len * kv * (M.d_model // M.n_head) in sizes, (kv, sizes)  # v, its own storage


@pytest.mark.parametrize("parallel_block", [False, True])
def test_saved_elements_within_115_percent_of_korthikanti(parallel_block):
    m = dataclasses.replace(M, parallel_block=parallel_block)
    elements = layer_bytes(measure(m, "none", B), M.n_layer) / 4 / SBH  # fp32: 4 bytes each
    assert PAPER[parallel_block] <= elements <= 1.15 * PAPER[parallel_block], elements


def test_parallel_block_saves_its_shared_input_once_under_autocast():
    # both branches' GEMMs read one bf16 copy of the normed input, not one cast each
    m = dataclasses.replace(M, parallel_block=True)
    saved = measure(m, "none", B, autocast=torch.bfloat16).tensors[1]
    normed = [shape for shape, dtype, _, _ in saved if dtype == torch.bfloat16 and shape[-1] == M.d_model
              and shape[:-1] in ((B, M.seq_len), (B * M.seq_len,))]
    assert len(normed) == 1, saved  # (the attention output is SDPA's, (b, nh, s, hd))
