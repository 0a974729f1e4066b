"""The multi-tensor optimizer kernels against the optimizers they replace: FusedAdamW against
torch.optim.AdamW, the LAMB halves against mshpc.optim.lamb.Lamb's per-tensor direction.

Tensors straddle the kernels' 65536-element chunks, and one is empty of gradient, so chunk
lookup and skipping are exercised. float32 throughout (the ZeRO masters' dtype): the fused
update computes the same expressions in another association, so they agree to float32
rounding, compounded over the steps (rtol 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from mshpc.kernels.ops import mshpc_ops
from mshpc.optim.lamb import Lamb
from mshpc.optim.multi_tensor import FusedAdamW

SIZES = (7, 65536, 65537 + 1000, 1, 200_000)
LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8


def tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in SIZES]


def two_groups(params: list[torch.Tensor]) -> list[dict]:
    # different lr and weight decay per group, as the scheduler and decay rules make them
    return [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0, "lr": LR / 3}]


def test_fused_adamw_matches_torch_adamw_and_shares_its_state():
    ours, theirs = tensors(), tensors()
    fused = FusedAdamW(two_groups(ours), lr=LR, betas=BETAS, eps=EPS)
    torch_adamw = torch.optim.AdamW(two_groups(theirs), lr=LR, betas=BETAS, eps=EPS, foreach=True)
    for step in range(4):
        grads = tensors(seed=10 + step)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            # the last tensor sits step 1 out (no gradient): its step count falls behind the rest
            sits_out = i == len(SIZES) - 1 and step == 1
            a.grad = None if sits_out else grads[i].clone()
            b.grad = None if sits_out else grads[i].clone()
        fused.step()
        torch_adamw.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        sa, sb = fused.state[a], torch_adamw.state[b]
        assert sa.keys() == sb.keys() and sa["step"].item() == sb["step"].item()
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-8)
    # a torch AdamW state dict loads into the fused optimizer and steps on the same way
    reloaded = FusedAdamW(two_groups([b.clone() for b in theirs]), lr=LR, betas=BETAS, eps=EPS)
    reloaded.load_state_dict(torch_adamw.state_dict())
    assert reloaded.state_dict()["state"][0]["step"].item() == 4


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lamb_halves_match_lamb(weight_decay):
    """One launch: moments, direction (written into the grads) and both squared norms per
    tensor; a second: p -= scale * r. Against Lamb._direction and the norms torch computes."""
    params, grads = tensors(), tensors(seed=1)
    ref = [p.clone() for p in params]
    lamb = Lamb(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    exp_avgs = [torch.full_like(p, 0.01) for p in params]  # a step in: non-zero moments
    exp_avg_sqs = [torch.full_like(p, 0.02) for p in params]
    for p, g, m, v in zip(ref, grads, exp_avgs, exp_avg_sqs):
        p.grad = g.clone()
        lamb.state[p] = {"step": torch.tensor(1.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    directions = [lamb._direction(p, lamb.param_groups[0]) for p in ref]  # step 2
    work = [g.clone() for g in grads]
    norms_sq = mshpc_ops.multi_tensor_lamb_direction(
        params, work, exp_avgs, exp_avg_sqs, [weight_decay] * len(params), *BETAS, EPS, 2)
    for r, got, p, m, v, q in zip(directions, work, params, exp_avgs, exp_avg_sqs, ref):
        torch.testing.assert_close(got, r, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, lamb.state[q]["exp_avg"], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(v, lamb.state[q]["exp_avg_sq"], rtol=1e-6, atol=1e-8)
    want = torch.stack([torch.stack([p.square().sum() for p in params]), torch.stack([r.square().sum() for r in directions])])
    # float32 sums of up to 200k squares, in chunk order against torch's pairwise order
    torch.testing.assert_close(norms_sq.T, want, rtol=5e-5, atol=0)
    scales = torch.linspace(0.5, 1.5, len(params))
    expected = [p - s * r for p, s, r in zip(params, scales, work)]
    mshpc_ops.multi_tensor_lamb_apply(params, work, scales)
    for got, want_p in zip(params, expected):
        torch.testing.assert_close(got, want_p, rtol=1e-6, atol=1e-7)


def test_norms_are_deterministic():
    # per-chunk partial sums added in chunk order: two runs agree bit for bit
    runs = []
    for _ in range(2):
        params, grads = tensors(), tensors(seed=1)
        zeros = [torch.zeros_like(p) for p in params]
        runs.append(mshpc_ops.multi_tensor_lamb_direction(
            params, grads, zeros, [z.clone() for z in zeros], [0.1] * len(params), *BETAS, EPS, 1))
    assert torch.equal(runs[0], runs[1])


def test_mismatched_tensors_fail_with_one_line():
    p = torch.zeros(10)
    with pytest.raises(RuntimeError, match="must be contiguous float32 with 10 elements"):
        mshpc_ops.multi_tensor_adamw([p], [torch.zeros(9)], [torch.zeros(10)], [torch.zeros(10)],
                                     [LR], [0.0], *BETAS, EPS, 1)


def test_opcheck():
    # schemas (which tensors each op mutates) and fake implementations agree with the kernels
    p, g, m, v = (torch.randn(70_000) for _ in range(4))
    torch.library.opcheck(torch.ops.mshpc.multi_tensor_adamw, ([p], [g], [m], [v.abs()], [LR], [0.1], *BETAS, EPS, 1))
    torch.library.opcheck(torch.ops.mshpc.multi_tensor_lamb_direction, ([p], [g], [m], [v.abs()], [0.1], *BETAS, EPS, 1))
    torch.library.opcheck(torch.ops.mshpc.multi_tensor_lamb_apply, ([p], [g], torch.tensor([0.5])))
