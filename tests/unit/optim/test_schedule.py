"""Warmup then cosine decay, as a function and as a LambdaLR on a real optimizer."""

import pytest
import torch

from mshpc.config import OptimConfig
from mshpc.optim.schedule import build_scheduler, lr_at

CFG = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
TOTAL = 20


def test_warmup_rises_linearly_to_the_peak():
    assert lr_at(0, CFG, TOTAL) == pytest.approx(0.25)  # lr / warmup_steps
    warm = [lr_at(s, CFG, TOTAL) for s in range(4)]
    assert warm == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_at(0, OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=0), TOTAL) == 1.0


def test_peak_once_then_monotone_cosine_to_min_lr():
    lrs = [lr_at(s, CFG, TOTAL) for s in range(TOTAL + 5)]
    assert max(lrs) == 1.0 and lrs.count(1.0) == 1
    decay = lrs[3 : TOTAL + 1]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert lr_at(3 + (TOTAL - 3) / 2, CFG, TOTAL) == pytest.approx(0.55)  # cosine midpoint
    assert lrs[TOTAL:] == [0.1] * 5  # min_lr at total_steps and after


def test_scheduler_drives_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=CFG.lr)
    sched = build_scheduler(opt, CFG, TOTAL)
    for step in range(TOTAL + 2):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step, CFG, TOTAL))
        opt.step()
        sched.step()
    assert all(isinstance(v, (int, float, list, type(None))) for v in sched.state_dict().values())
