"""The mixture-of-experts layer on one process: routing (dropless: every token to exactly its top
k; with a capacity: exactly the formula's count dropped, the lightest), the layer against a
token-by-token reference, grouped GEMMs against the loop, the router's losses and their
gradient, the sigmoid-bias router, statistics under recomputation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from support.cli_runner import REPO

from mshpc.config import ModelConfig, MoEConfig, load_config
from mshpc.kernels.reference import swiglu
from mshpc.model.gpt import GPT, loss_fn
from mshpc.model.moe import STATS, MoE
from mshpc.model.router import aux_loss, capacity, z_loss
from mshpc.parallel.apply import apply_activation_checkpointing

MOE = MoEConfig(n_experts=6, top_k=2, expert_ffn_dim=24)
CFG = ModelConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16, mlp="swiglu", moe=MOE)


def layer(dtype: torch.dtype = torch.float64, **moe) -> MoE:
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, **moe))
    model = GPT(cfg).to(dtype)
    out = model.layers["0"].mlp
    assert isinstance(out, MoE)
    return out


def reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its k experts of weight * expert(x), as transformers' loop does."""
    r = m.router(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(m.moe.top_k):
            if r.pos[t, j] < 0:
                continue
            e = r.experts[t, j]
            h = swiglu(x[t] @ m.experts.fc[e].T) @ m.experts.proj[e].T
            out[t] += r.weights[t, j].to(x.dtype) * h
    if m.shared is not None:
        out = out + m.shared_output(x)
    return out


def test_dropless_sends_every_token_to_exactly_its_top_k_experts():
    m = layer()
    x = torch.randn(40, 16, dtype=torch.float64)
    x[:, 0] = torch.arange(40)  # the first feature names the token
    seen: dict[int, list[int]] = {}

    def record(xp: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        for e, rows in enumerate(xp.split(counts.tolist())):
            seen[e] = sorted(int(v) for v in rows[:, 0])
        return xp

    r = m.router(x)
    m.experts.forward = record  # type: ignore[method-assign]
    m.dispatch.start(x, r, m).finish()
    for e in range(MOE.n_experts):
        want = sorted(t for t in range(40) if e in r.experts[t].tolist())
        assert seen[e] == want
    assert sum(len(v) for v in seen.values()) == 40 * MOE.top_k
    assert r.rows == 40 * MOE.top_k and int(r.dropped) == 0
    assert torch.equal(r.experts, r.scores.topk(MOE.top_k).indices)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_exactly_the_formulas_count_the_lightest_first(factor):
    m = layer(capacity_factor=factor)
    x = torch.randn(50, 16, dtype=torch.float64)
    r = m.router(x)
    cap = math.ceil(factor * 50 * MOE.top_k / MOE.n_experts)
    assert capacity(50, m.moe) == cap
    routed = torch.bincount(r.experts.flatten(), minlength=MOE.n_experts)
    assert int(r.dropped) == sum(max(0, int(n) - cap) for n in routed)
    assert r.rows == int(r.counts.sum()) == 100 - int(r.dropped)
    for e in range(MOE.n_experts):  # each expert keeps its heaviest copies
        mine = r.experts == e
        kept, dropped = r.weights[mine & (r.pos >= 0)], r.weights[mine & (r.pos < 0)]
        assert len(kept) == min(cap, int(routed[e]))
        if len(dropped):
            assert kept.min() >= dropped.max()
    assert sorted(r.pos[r.pos >= 0].tolist()) == list(range(r.rows))  # kept rows named once each


@pytest.mark.parametrize("moe", [{}, {"capacity_factor": 0.75}, {"n_shared_experts": 2, "shared_expert_gate": True},
                                 {"router": "sigmoid_bias"}, {"norm_topk_prob": False}])
def test_layer_equals_the_token_by_token_reference(moe):
    m = layer(experts_impl="loop", **moe)  # float64: _grouped_mm has no float64
    x = torch.randn(30, 16, dtype=torch.float64)
    torch.testing.assert_close(m.dispatch.start(x, m.router(x), m).finish(), reference(m, x), rtol=1e-12, atol=1e-12)


def test_grouped_gemm_equals_the_loop_with_gradients():
    x = torch.randn(64, 16)
    outs = []
    for impl in ("grouped_mm", "loop"):
        m = layer(torch.float32, experts_impl=impl)
        xp = x.clone().requires_grad_()
        out = m(xp.view(4, 16, 16)).sum()
        out.backward()
        outs.append((out.detach(), xp.grad, m.experts.fc.grad, m.experts.proj.grad, m.router.weight.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_aux_and_z_losses_by_hand():
    moe = dataclasses.replace(MOE, n_experts=2, top_k=1)
    scores = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.25, 0.75], [0.5, 0.5]])
    routed = torch.tensor([3, 1])
    # E * sum_i f_i P_i: f = (3/4, 1/4), P = (2/4, 2/4) -> 2 * (3/8 + 1/8) = 1
    assert aux_loss(scores, routed, 4, moe).item() == pytest.approx(1.0)
    assert aux_loss(scores, torch.tensor([4, 0]), 4, moe).item() == pytest.approx(1.0)  # P balanced: 2 * 4/4 * 1/2
    logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    want = (math.log(2) ** 2 + (1 + math.log(2)) ** 2) / 2
    assert z_loss(logits, 2).item() == pytest.approx(want)


def test_router_losses_reach_the_router_gradient_with_their_coefficients():
    """The layer hooks coef * aux + coef * z onto its output's gradient: the router's gradient
    equals that of (loss + coef_aux * aux + coef_z * z) computed by hand."""
    m = layer(torch.float64, aux_loss_coef=0.3, z_loss_coef=0.2, experts_impl="loop")
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    m(x).square().sum().backward()
    got = m.router.weight.grad.clone()
    m.zero_grad()
    tokens = x.reshape(-1, 16)
    r = m.router(tokens)
    extra = 0.3 * aux_loss(r.scores, r.routed, 16, m.moe) + 0.2 * z_loss(r.logits, 16)
    (m.dispatch.start(tokens, r, m).finish().square().sum() + extra).backward()
    torch.testing.assert_close(got, m.router.weight.grad, rtol=1e-12, atol=1e-12)


def test_sigmoid_bias_picks_experts_without_weighing_them():
    m = layer(router="sigmoid_bias")
    x = torch.randn(20, 16, dtype=torch.float64)
    before = m.router(x)
    assert m.router.expert_bias is not None
    m.router.expert_bias[3] = 10.0  # expert 3 now wins every token's first place
    after = m.router(x)
    assert (after.experts[:, 0] == 3).all()
    scores = torch.sigmoid(x @ m.router.weight.T)
    w = scores.gather(1, after.experts)
    torch.testing.assert_close(after.weights, w / w.sum(-1, keepdim=True))
    assert not torch.equal(before.experts, after.experts)


def test_statistics_count_a_recomputed_forward_once():
    """Under full activation checkpointing (parallel/apply.py) each layer runs forward twice."""
    torch.manual_seed(0)
    model = GPT(CFG)
    apply_activation_checkpointing(model, "full")
    idx = torch.randint(0, 32, (2, 16))
    loss_fn(model(idx), idx).backward()
    m, e = model.layers["0"].mlp, MOE.n_experts
    assert m.stats[:e].sum() == 32 * MOE.top_k
    assert m.stats[e + STATS.index("micro_batches")] == 1
    with torch.no_grad():  # evaluation records nothing
        model(idx)
    assert m.stats[:e].sum() == 32 * MOE.top_k


def test_dense_and_moe_layers_follow_first_dense_and_every():
    cfg = dataclasses.replace(CFG, n_layer=6, moe=dataclasses.replace(MOE, first_dense_layers=1, every=2))
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == [2, 4]
    model = GPT(cfg)
    assert [isinstance(b.mlp, MoE) for b in model.layers.values()] == [False, False, True, False, True, False]
    logits = model(torch.randint(0, 32, (2, 16)))
    loss_fn(logits, torch.randint(0, 32, (2, 16))).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_swiglu_expert_is_the_dense_mlp():
    """One expert, top 1, its weights the dense MLP's: the layer computes the MLP exactly."""
    m = layer(n_experts=1, top_k=1, aux_loss_coef=0.0, experts_impl="loop")
    x = torch.randn(5, 16, dtype=torch.float64)
    want = F.linear(swiglu(F.linear(x, m.experts.fc[0])), m.experts.proj[0])
    torch.testing.assert_close(m(x), want, rtol=1e-12, atol=1e-12)


def test_tiny_moe_config_builds_and_learns_one_step():
    """configs/tiny-moe.yaml as shipped: 8 experts of 256 in each of 4 layers, top 2."""
    cfg = load_config(REPO / "configs/tiny-moe.yaml")
    assert cfg.model.moe_layers == 4 and cfg.parallel.dp == 2
    torch.manual_seed(0)
    model = GPT(cfg.model)
    experts = 4 * 8 * 3 * 256 * 256
    assert model.num_params() == experts + GPT(dataclasses.replace(cfg.model, moe=None, ffn_dim=1)).num_params() \
        - 4 * 3 * 256 + 4 * 8 * 256  # the dense MLPs (width 1 here) out, the routers in
    idx = torch.randint(0, 257, (2, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = loss_fn(model(idx[:, :-1]), idx[:, 1:])
    first.backward()
    opt.step()
    assert loss_fn(model(idx[:, :-1]), idx[:, 1:]) < first
