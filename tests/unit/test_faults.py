"""The test-only fault spec (MSHPC_TEST_FAULTS): the preflight kinds carry no step, the `slow`
kind makes a forward really take longer, and the hooks built from it are a no-op for a rank
with no fault (so a production run pays nothing, not even in its collectives)."""

import time

import pytest
import torch
from torch import nn

from mshpc.errors import ConfigError
from mshpc.fault_hooks import NO_FAULTS
from mshpc.fault_setup import build_fault_hooks
from mshpc.faults import SLOW_FACTOR, Fault, install_slowdown, parse_faults, planned
from mshpc.launch.env import LaunchEnv
from mshpc.launch.rendezvous import DistInfo
from mshpc.parallel import comm
from mshpc.parallel.comm import FlightRecorder

FORWARD_S = 0.02


class Sleepy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return x


def test_slow_spec_parses_and_bad_ones_say_how():
    assert parse_faults("slow:rank=1:step=50:factor=1.15;kill:rank=0:step=3") == (
        Fault("slow", 1, 50, 1.15), Fault("kill", 0, 3))
    assert parse_faults("slow_save:rank=0:step=4:factor=3") == (Fault("slow_save", 0, 4, 3.0),)
    for bad, says in (("slow:rank=1:step=5", "slow_save: also :factor=F"), ("slow_save:rank=0:step=4", "factor"), ("slow:rank=1:step=5:factor=0.5", ">= 1"),
                      ("kill:rank=0:step=1:factor=2", "KIND:rank=R:step=S")):
        with pytest.raises(ConfigError, match=says):
            parse_faults(bad)


def test_forwards_of_the_slow_rank_take_factor_times_as_long_from_its_step(monkeypatch):
    real_sleep, asked = time.sleep, []
    monkeypatch.setattr(time, "sleep", lambda s: (asked.append(s), real_sleep(s)))
    model = Sleepy()
    # resumed at step 1 with 2 forwards per step: forwards 1 and 2 are step 1, 3 and 4 step 2 (slow)
    install_slowdown(model, parse_faults("slow:rank=3:step=2:factor=3;slow:rank=0:step=0:factor=9"),
                     rank=3, start_step=1, forwards_per_step=2)
    for _ in range(4):
        model(torch.zeros(1))
    own = [s == FORWARD_S for s in asked]
    assert own == [True, True, True, False, True, False]  # the injector sleeps after forwards 3 and 4 only
    # each of its sleeps is (factor - 1) x the forward it follows: at least 2 x 20 ms
    assert all(s >= 2 * FORWARD_S for s, mine in zip(asked, own, strict=True) if not mine)


def test_preflight_faults_name_a_rank_and_no_step():
    faults = parse_faults("gemm_slow:rank=1; gemm_wrong:rank=2;raise:rank=0:step=3")
    assert faults == (Fault("gemm_slow", 1, 0), Fault("gemm_wrong", 2, 0), Fault("raise", 0, 3))
    assert planned(faults, "gemm_slow", 1) and not planned(faults, "gemm_slow", 2)
    assert planned(faults, "gemm_wrong", 2) and not planned(faults, "gemm_wrong", 0)


@pytest.mark.parametrize("spec", ["gemm_slow:rank=1:step=2", "raise:rank=1", "gemm_fast:rank=1"])
def test_a_malformed_fault_is_a_config_error(spec):
    with pytest.raises(ConfigError, match="MSHPC_TEST_FAULTS"):
        parse_faults(spec)


def _hooks(spec: str | None, rank: int = 1):
    env = LaunchEnv(launcher="env", rank=rank, world_size=4, local_rank=rank, local_world_size=4, node="n0",
                    master_addr=None, master_port=None, slurm=None, test_faults=spec)
    return build_fault_hooks(env, DistInfo(rank, 4, rank, 4, "n0", "gloo", "env"))


def test_a_rank_with_no_fault_gets_the_no_op_hooks():
    for spec in (None, "gemm_slow:rank=2;kill:rank=0:step=3", "raise:node=n1:step=1"):
        hooks = _hooks(spec)
        assert hooks is NO_FAULTS, spec
        assert (hooks.gemm_slow_factor, hooks.gemm_wrong) == (1, False)
        hooks.at_step(0), hooks.before_commit(1)  # nothing fires


def test_the_preflight_faults_reach_the_gemms_of_their_rank_only():
    assert (_hooks("gemm_slow:rank=1").gemm_slow_factor, _hooks("gemm_slow:rank=1").gemm_wrong) == (SLOW_FACTOR, False)
    assert _hooks("gemm_wrong:rank=1").gemm_wrong and _hooks("gemm_wrong:rank=1").gemm_slow_factor == 1
    assert _hooks("gemm_wrong:node=n0").gemm_wrong  # by node too: whichever rank runs there


def test_a_malformed_spec_fails_on_every_rank_not_only_the_targeted_one():
    with pytest.raises(ConfigError, match="MSHPC_TEST_FAULTS"):
        _hooks("raise:rank=0", rank=3)


def test_raise_in_collective_fails_the_next_collective_once(monkeypatch):
    recorder = FlightRecorder()
    monkeypatch.setattr(comm, "RECORDER", recorder)
    monkeypatch.setattr(comm, "collective", comm.collective)  # comm's own door again after the test
    issued = []
    comm.collective(None, "all_reduce", 4, lambda: issued.append(1))  # nothing armed: the collective goes through
    _hooks("raise_in_collective:rank=1:step=2").at_step(2)
    with pytest.raises(RuntimeError, match="injected fault at rank 1 step 2 .inside a collective."):
        comm.collective(None, "all_reduce", 4, lambda: issued.append(2))
    comm.collective(None, "all_reduce", 4, lambda: issued.append(3))  # one-shot
    assert issued == [1, 3]
    assert [r.seq for r in recorder.snapshot()] == [1, 2, 3]  # the failing collective is still recorded
