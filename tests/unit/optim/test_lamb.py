"""Lamb against a reference written straight from You et al. 2019, Algorithm 2."""

import copy
import math

import torch
from torch import nn

from mshpc.optim.lamb import Lamb

LR, BETAS, EPS, WD = 0.01, (0.9, 0.99), 1e-6, 0.1


class ReferenceLamb:
    """Algorithm 2, one tensor at a time, with plain Python scalars for every coefficient."""

    def __init__(self, params: list[torch.Tensor], weight_decays: list[float]) -> None:
        self.w = [p.detach().clone() for p in params]
        self.wd = weight_decays
        self.m = [torch.zeros_like(p) for p in self.w]
        self.v = [torch.zeros_like(p) for p in self.w]
        self.t = 0

    def step(self, grads: list[torch.Tensor]) -> None:
        self.t += 1
        b1, b2 = BETAS
        for i, g in enumerate(grads):
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            m_hat = self.m[i] / (1 - b1**self.t)
            v_hat = self.v[i] / (1 - b2**self.t)
            r = m_hat / (torch.sqrt(v_hat) + EPS) + self.wd[i] * self.w[i]
            w_norm, r_norm = self.w[i].norm().item(), r.norm().item()
            trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
            self.w[i] = self.w[i] - LR * trust * r


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3)).double()


def groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> list:
    """Run `steps` steps on fixed random batches; return each step's gradients."""
    gen = torch.Generator().manual_seed(seed)
    seen = []
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        seen.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])
        opt.step()
    return seen


def test_matches_reference_over_steps_with_two_groups():
    model = small_model()
    opt = Lamb(groups(model), lr=LR, betas=BETAS, eps=EPS)
    ordered = [p for g in opt.param_groups for p in g["params"]]
    ref = ReferenceLamb(ordered, [g["weight_decay"] for g in opt.param_groups for _ in g["params"]])
    for grads in train(model, opt, steps=6):
        ref.step(grads)
    for p, w in zip(ordered, ref.w):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(ordered, small_model().parameters()))


def test_trust_ratio_is_one_for_a_zero_weight_or_zero_update():
    zero = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    still = nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = Lamb([zero, still], lr=LR, betas=BETAS, eps=EPS)
    zero.grad = torch.tensor([1.0, -2.0, 0.5, 3.0, -0.1], dtype=torch.float64)
    still.grad = torch.zeros(3, dtype=torch.float64)
    opt.step()
    # Step 1: m_hat = g and v_hat = g^2, so r = g / (|g| + eps), applied with ratio 1.
    torch.testing.assert_close(zero.detach(), -LR * zero.grad / (zero.grad.abs() + EPS))
    assert torch.equal(still.detach(), torch.ones(3, dtype=torch.float64))  # r = 0: no NaN


def test_state_dict_is_plain_and_resume_is_exact():
    model, resumed = small_model(), small_model()
    opt = Lamb(groups(model), lr=LR, betas=BETAS, eps=EPS)
    train(model, opt, steps=2)
    state = copy.deepcopy(opt.state_dict())  # as saved: not aliasing the live moments
    for entry in state["state"].values():
        assert all(isinstance(v, (torch.Tensor, int, float)) for v in entry.values())
    resumed.load_state_dict(model.state_dict())
    opt_resumed = Lamb(groups(resumed), lr=LR, betas=BETAS, eps=EPS)
    opt_resumed.load_state_dict(state)
    train(model, opt, steps=2, seed=1)
    train(resumed, opt_resumed, steps=2, seed=1)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert math.isclose(opt.state_dict()["state"][0]["step"].item(), 4.0)
