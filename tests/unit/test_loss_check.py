"""The loss check: NaN, Inf and a loss above supervisor.loss_limit stop training; others pass."""

import pytest

from mshpc.loss_check import LossDiverged, check_loss


@pytest.mark.parametrize("loss, limit", [(float("nan"), None), (float("inf"), None), (12.5, 10.0)])
def test_a_diverged_loss_raises_with_its_step(loss, limit):
    with pytest.raises(LossDiverged, match=f"loss {loss} at step 5 "):
        check_loss(loss, 4, limit)


@pytest.mark.parametrize("limit", [None, 10.0])
def test_a_finite_loss_within_the_limit_passes(limit):
    check_loss(9.99, 4, limit)
