"""Pipeline schedules as data: every plan runs to the end against its peers (pipe_sim), holds the
activations 1F1B and interleaved 1F1B promise, and has the bubble the papers compute."""

from __future__ import annotations

from collections import Counter

import pytest

from mshpc.parallel.schedules import PipeShape, bubble_fraction, build_plan, compute_order, link, lower, peak_live
from support.pipe_sim import Deadlock, simulate

SHAPES = [PipeShape(p, v, m) for p in (2, 3, 4) for v in (1, 2, 3) for m in range(1, 13)
          if v == 1 or m % p == 0]


def plans(name: str, shape: PipeShape) -> list:
    return [build_plan(name, shape, r) for r in range(shape.pp)]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_every_plan_completes_and_each_message_meets_its_receive(name):
    for shape in SHAPES:
        simulate(plans(name, shape), shape)  # raises on a deadlock or a mismatched message


def test_the_simulator_finds_a_deadlock_and_a_crossed_message():
    shape = PipeShape(2, 1, 4)
    good = plans("1f1b", shape)
    order = compute_order("1f1b", shape, 0)
    backward_first = lower([order[2], *order[:2], *order[3:]], shape)  # B0 before F0's result returns
    with pytest.raises(Deadlock):
        simulate([backward_first, good[1]], shape)
    first, second = [i for i, a in enumerate(good[1]) if a.op == "recv_act"][:2]
    crossed = list(good[1])
    crossed[first], crossed[second] = crossed[second], crossed[first]
    with pytest.raises(AssertionError, match="met"):
        simulate([good[0], crossed], shape)


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_every_micro_batch_runs_forward_and_backward_once_on_every_stage(name):
    for shape in SHAPES:
        done = Counter((a.op, a.micro, a.stage) for r in range(shape.pp) for a in compute_order(name, shape, r))
        want = {(op, mb, g) for op in ("forward", "backward") for mb in range(shape.micro_batches)
                for g in range(shape.stages)}
        assert set(done) == want and set(done.values()) == {1}, shape


def test_a_stage_runs_backward_only_after_its_forward():
    for shape in SHAPES:
        for r in range(shape.pp):
            seen = set()
            for a in compute_order("1f1b", shape, r):
                assert a.op == "forward" or (a.micro, a.stage) in seen, (shape, r, a)
                seen.add((a.micro, a.stage))


def test_1f1b_holds_at_most_pp_minus_stage_micro_batches():
    # PipeDream-Flush / Megatron 1F1B: stage s keeps the activations of min(p - s, m) micro-batches
    for shape in (s for s in SHAPES if s.virtual_stages == 1):
        for r in range(shape.pp):
            assert peak_live(build_plan("1f1b", shape, r)) == min(shape.pp - r, shape.micro_batches), (shape, r)
            assert peak_live(build_plan("gpipe", shape, r)) == shape.micro_batches  # the baseline's m


def test_interleaved_holds_what_megatron_promises():
    # Narayanan et al. 2021 sec. 2.2 / Megatron-LM: rank r warms up with 2 (p - r - 1) + (v - 1) p
    # chunk forwards, so at most that plus one chunk activations are live (each 1/v of a stage):
    # for rank 0 about p (1 + (p - 1) / (p v)) stages' worth, 1F1B's p plus less than one.
    for shape in (s for s in SHAPES if s.virtual_stages > 1):
        p, v, m = shape.pp, shape.virtual_stages, shape.micro_batches
        for r in range(p):
            promise = min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
            assert peak_live(build_plan("1f1b", shape, r)) == promise, (shape, r)
            if m >= 2 * p:  # enough micro-batches to reach the steady state: well below GPipe's m*v
                assert promise < m * v


def test_1f1b_and_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    for shape in (s for s in SHAPES if s.virtual_stages == 1):
        for name in ("1f1b", "gpipe"):
            t = simulate(plans(name, shape), shape)
            assert t.bubble == pytest.approx(bubble_fraction(shape)), (name, shape)


def test_interleaving_shrinks_the_bubble_as_narayanan_computes():
    # with forward and backward of equal cost Megatron's order meets (p - 1) / (v m + p - 1)
    # exactly; with backward = 2 forward it stays within the 1F1B bubble and near the formula
    for shape in (s for s in SHAPES if s.virtual_stages > 1 and s.micro_batches >= s.pp):
        flat = PipeShape(shape.pp, 1, shape.micro_batches)
        equal = simulate(plans("1f1b", shape), shape, forward=1.0, backward=1.0)
        assert equal.bubble == pytest.approx(bubble_fraction(shape)), shape
        real = simulate(plans("1f1b", shape), shape)
        assert real.bubble < simulate(plans("1f1b", flat), flat).bubble, shape


def test_receives_are_posted_before_the_compute_before_the_one_that_needs_them():
    # decoupled send/recv: the receive for a compute is posted at least one compute earlier
    # (so its transfer overlaps that compute), except the very first of each link
    shape = PipeShape(4, 2, 8)
    for r in range(shape.pp):
        plan = build_plan("1f1b", shape, r)
        computes = [i for i, a in enumerate(plan) if a.op in ("forward", "backward")]
        for n, i in enumerate(computes):
            a = plan[i]
            recv = {"forward": "recv_act", "backward": "recv_grad"}[a.op]
            posts = [j for j, b in enumerate(plan) if b.op == recv and (b.micro, b.stage) == (a.micro, a.stage)]
            if posts and n > 0:
                assert posts[0] < computes[n - 1], (r, a)


def test_links_carry_one_direction_each():
    shape = PipeShape(2, 2, 4)
    ends = {}
    for r in range(shape.pp):
        for a in build_plan("1f1b", shape, r):
            if a.op.startswith("send"):
                name, peer = link(a, shape.pp)
                ends.setdefault(name, set()).add((r, peer))
    # with pp=2 both directions join the same two ranks: each link still goes one way only
    assert ends == {"act": {(0, 1)}, "act_wrap": {(1, 0)}, "grad": {(1, 0)}, "grad_wrap": {(0, 1)}}
