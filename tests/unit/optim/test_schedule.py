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


WSD = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="wsd", decay_fraction=0.25)


def test_wsd_warms_up_holds_the_peak_then_decays_to_min_lr_in_the_last_fraction():
    lrs = [lr_at(s, WSD, TOTAL) for s in range(TOTAL + 3)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # the same warmup as cosine
    assert lrs[3:15] == [1.0] * 12  # stable: the peak until the last 25% (5 of 20 steps)
    decay = lrs[15:TOTAL + 1]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert lrs[TOTAL:] == pytest.approx([0.1] * 3)
    # 1 - sqrt by default (Hägele et al. 2024): below the linear decay at every point inside it
    linear = OptimConfig(**{**WSD.__dict__, "decay_shape": "linear"})
    assert lr_at(16, linear, TOTAL) == pytest.approx(0.1 + 0.9 * (1 - 1 / 5))
    assert lr_at(16, WSD, TOTAL) == pytest.approx(0.1 + 0.9 * (1 - (1 / 5) ** 0.5))


def test_constant_holds_the_peak_after_warmup_and_schedule_is_a_config_choice():
    from mshpc.config import load_config
    from mshpc.errors import ConfigError

    constant = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="constant")
    assert [lr_at(s, constant, TOTAL) for s in range(3, TOTAL + 2)] == [1.0] * (TOTAL - 1)
    assert load_config(None, ["optim.schedule=wsd"]).optim.schedule == "wsd"
    with pytest.raises(ConfigError, match=r"optim.schedule='step' is not a valid choice \(choose 'cosine' or 'wsd' "
                                          r"or 'constant'\)"):
        load_config(None, ["optim.schedule=step"])
    with pytest.raises(ConfigError, match="optim.decay_fraction=1.5 must be between 0 and 1"):
        load_config(None, ["optim.decay_fraction=1.5"])
