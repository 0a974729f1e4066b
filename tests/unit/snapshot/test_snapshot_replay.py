"""The replay rules: what is suspicious, and how two runs of a step are judged."""

import math

import torch
from torch import nn

from mshpc.snapshot.replay import GradFingerprint, ReplayLedger, SpikeWatch, StepResult
from mshpc.snapshot.restore import choose_step
from mshpc.snapshot.placement import Buddies


def test_nan_inf_and_spikes_past_the_factor_are_suspicious_once_the_median_means_something():
    watch = SpikeWatch(factor=10.0, window=5)
    assert watch.suspicious(float("nan"), 1.0) == "loss nan"
    assert watch.suspicious(2.0, math.inf) == "gradient norm inf"
    assert watch.suspicious(2.0, 500.0) is None  # no history yet: only NaN/Inf count
    for norm in (1.0, 1.2, 0.9):
        watch.accept(2.0, norm)
    assert watch.suspicious(2.0, 11.0).startswith("gradient norm 11 > 10 x its running median 1")
    assert watch.suspicious(25.0, 1.0).startswith("loss 25 > 10 x")
    assert watch.suspicious(19.0, 9.0) is None


def _r(loss, norm, grad_sq):
    return StepResult(loss, norm, grad_sq)


def test_identical_runs_are_reproducible_nan_included():
    ledger = ReplayLedger(persistent_after=2)
    first = [_r(float("nan"), 1.0, float("nan")), _r(float("nan"), 1.0, 5.0)]
    assert ledger.judge(first, list(first)).kind == "reproducible"


def test_a_rank_that_differs_is_transient_then_persistent_the_second_time():
    ledger = ReplayLedger(persistent_after=2)
    clean = [_r(2.0, 1.0, 4.0), _r(2.0, 1.0, 5.0)]
    flipped = [_r(2.0, 1e19, 4.0), _r(2.0, 1e19, 1e38)]
    once = ledger.judge(flipped, clean)
    assert (once.kind, once.ranks) == ("transient", (1,))
    assert once.differed["rank 1"] == "local gradient sum of squares 1e+38 then 5.0"
    assert "gradient norm 1e+19 then 1.0" in once.differed["global"]
    again = ledger.judge(flipped, clean)
    assert (again.kind, again.ranks) == ("persistent", (1,))


def test_step_results_travel_as_json_exactly():
    r = _r(float("nan"), math.inf, 0.1 + 0.2)
    back = StepResult.from_json(r.as_json())
    assert math.isnan(back.loss) and back.grad_norm == math.inf and back.local_grad_sq == 0.1 + 0.2


def test_the_fingerprint_sums_each_steps_local_gradients():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    fp = GradFingerprint(model, torch.device("cpu"))
    x = torch.randn(5, 4)
    model(x).square().sum().backward()
    expected = sum(float(p.grad.double().square().sum()) for p in model.parameters())
    assert math.isclose(fp.take(), expected, rel_tol=1e-6)
    assert fp.take() == 0.0


def _offer(alive, own=(), wards=None):
    return {"alive": alive, "own": list(own), "wards": wards or {}, "problems": []}


def test_the_newest_step_every_rank_has_whole_is_chosen():
    ring = Buddies((1, 2, 0), "ring")  # rank 0's copy on 1, 1's on 2, 2's on 0
    offers = [_offer(True, (5, 6), {"2": [5, 6]}), _offer(False), _offer(True, (6, 5), {"1": [5]})]
    assert choose_step(offers, ring) == (5, "")  # rank 1's buddy kept step 5 only


def test_no_step_when_a_rank_and_its_buddy_are_both_lost():
    ring = Buddies((1, 2, 0), "ring")
    offers = [_offer(True, (5, 6), {"2": [5, 6]}), _offer(False), _offer(False)]
    step, why = choose_step(offers, ring)
    assert step is None and why == "rank 1 and its buddy rank 2 were both lost"


def test_no_step_when_the_kept_copies_are_not_whole():
    ring = Buddies((1, 0), "ring")
    offers = [_offer(True, (5, 6), {"1": []}), _offer(False)]
    assert choose_step(offers, ring) == (None, "no whole snapshot of rank 1 is left")
