"""GPT: shapes, serial vs parallel blocks, tied weights, causality, init, a training smoke test."""

import dataclasses

import pytest
import torch

from mshpc.config import ModelConfig
from mshpc.errors import ConfigError
from mshpc.model.gpt import GPT, RMSNorm, loss_fn

TINY = ModelConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16, norm="rmsnorm")


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(TINY, **overrides))


def tokens(b: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("parallel_block", [False, True])
def test_logits_shape_dtype_and_grads(parallel_block):
    model = tiny(parallel_block=parallel_block)
    logits = model(tokens())
    assert logits.shape == (2, 16, 32) and logits.dtype == torch.float32
    loss_fn(logits, tokens()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_parallel_block_has_one_norm_and_differs_from_serial():
    serial, parallel = tiny(), tiny(parallel_block=True)
    for block in parallel.layers.values():
        assert sum(isinstance(m, RMSNorm) for m in block.modules()) == 1
    assert serial.num_params() - parallel.num_params() == TINY.n_layer * TINY.d_model
    # Same weights wherever both have them; only the wiring differs.
    missing, unexpected = parallel.load_state_dict(serial.state_dict(), strict=False)
    assert not missing and all(".ln_2." in k for k in unexpected)
    assert not torch.allclose(serial(tokens()), parallel(tokens()))


def test_tied_embeddings_share_storage_and_count_once():
    tied, untied = tiny(), tiny(tie_embeddings=False)
    assert tied.lm_head.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    table = TINY.vocab_size * TINY.d_model
    assert untied.num_params() - tied.num_params() == table
    assert tied.num_params(exclude_embeddings=True) == tied.num_params() - table
    assert untied.num_params(exclude_embeddings=True) == tied.num_params(exclude_embeddings=True)


def test_state_dict_holds_only_parameters():
    model = tiny(sliding_window=4)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set(model.state_dict()) == names  # RoPE tables and the window mask are derived


@pytest.mark.parametrize(
    "overrides", [{}, {"parallel_block": True}, {"sliding_window": 3}, {"norm": "layernorm"}]
)
def test_causal(overrides):
    model = tiny(**overrides).eval()
    idx = tokens()
    for t in (0, 5, 15):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % TINY.vocab_size
        before, after = model(idx), model(changed)
        torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=0)
        assert not torch.allclose(after[:, t], before[:, t])


def test_one_layer_window_sees_only_last_w_tokens():
    w, p = 3, 4
    model = tiny(n_layer=1, sliding_window=w).eval()
    idx = tokens()
    changed = idx.clone()
    changed[:, p] = (changed[:, p] + 1) % TINY.vocab_size
    before, after = model(idx), model(changed)
    # Position i sees tokens i - w + 1..i, so token p reaches positions p..p + w - 1 only.
    torch.testing.assert_close(after[:, p + w :], before[:, p + w :], rtol=0, atol=0)
    for i in range(p, p + w):
        assert not torch.allclose(after[:, i], before[:, i]), i


def test_init_scales_residual_projections():
    cfg = dict(n_layer=8, d_model=64, n_head=2)
    model = tiny(**cfg)
    std = TINY.init_std
    assert abs(model.layers["0"].attn.qkv.weight.std().item() / std - 1) < 0.05
    for layer in model.layers.values():
        for proj in (layer.attn.proj.weight, layer.mlp.proj.weight):
            assert abs(proj.std().item() / (std / 4.0) - 1) < 0.1  # 1/sqrt(2 * 8) = 1/4
        assert torch.equal(layer.ln_1.weight, torch.ones(64))


def test_swiglu_mlp_is_silu_gate_times_up_then_down():
    """fc holds [gate; up] rows of model.ffn_dim each and proj is the down projection: the block's
    MLP is W_down (silu(W_gate x) * (W_up x)), Llama's, with no biases."""
    model = tiny(mlp="swiglu", ffn_dim=24)
    mlp = model.layers["0"].mlp
    assert mlp.fc.weight.shape == (2 * 24, 16) and mlp.proj.weight.shape == (16, 24)
    assert mlp.fc.bias is None and mlp.fc_bias is None and mlp.proj.bias is None
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    gate, up = mlp.fc.weight[:24], mlp.fc.weight[24:]
    want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ mlp.proj.weight.T
    torch.testing.assert_close(mlp(x), want)
    n_matrices = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.mlp"))
    assert n_matrices == 3 * 24 * 16


def test_swiglu_init_scales_down_projection():
    model = tiny(mlp="swiglu", n_layer=8, d_model=64, n_head=2, ffn_dim=160)
    for layer in model.layers.values():
        assert abs(layer.mlp.fc.weight.std().item() / TINY.init_std - 1) < 0.05
        assert abs(layer.mlp.proj.weight.std().item() / (TINY.init_std / 4.0) - 1) < 0.1  # 1/sqrt(2 * 8)


def test_dropout_only_in_training():
    plain, dropped = tiny(), tiny(dropout=0.5)
    idx = tokens()
    torch.testing.assert_close(dropped.eval()(idx), plain.eval()(idx), rtol=0, atol=0)
    assert not torch.allclose(dropped.train()(idx), plain(idx))


def test_loss_is_fp32_and_rejects_long_inputs():
    logits = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    targets = torch.randint(0, 32, (2, 3))
    loss = loss_fn(logits, targets)
    assert loss.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(logits.float().view(6, 32), targets.view(6))
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ConfigError, match="model.seq_len=16"):
        tiny()(tokens(s=17))


def test_memorizes_a_batch():
    model = tiny(sliding_window=8)
    idx = tokens(s=17)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = loss_fn(model(idx[:, :-1]), idx[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert abs(first - torch.log(torch.tensor(32.0)).item()) < 0.1  # small init: near uniform
    assert loss.item() < 0.5 * first


@pytest.mark.parametrize("window", [None, 3])
def test_doc_mask_makes_each_packed_document_see_only_itself(window):
    """A row packing documents A (6 tokens) and B (10) gives B's positions the logits of B run
    alone: no attention crosses the boundary, and RoPE needs no position reset."""
    model = tiny(sliding_window=window).double()
    row = tokens(1, 16)
    segments = torch.tensor([[0] * 6 + [1] * 10], dtype=torch.int32)
    packed = model(row, segments)
    torch.testing.assert_close(packed[:, 6:], model(row[:, 6:]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(packed[:, :6], model(row[:, :6]), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(model(row)[:, 6:], packed[:, 6:])  # without the mask B sees A


def test_doc_mask_of_one_document_is_the_plain_causal_model():
    model = tiny().double()
    row = tokens(2, 16)
    one_doc = torch.zeros(2, 16, dtype=torch.int32)
    torch.testing.assert_close(model(row, one_doc), model(row), rtol=1e-10, atol=1e-10)
