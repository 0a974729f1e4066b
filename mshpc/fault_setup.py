"""The one place the test faults of MSHPC_TEST_FAULTS become a FaultHooks object: the train loop,
preflight and the saver receive it and never import mshpc.faults themselves."""

from __future__ import annotations

from pathlib import Path

from mshpc.fault_hooks import NO_FAULTS, FaultHooks
from mshpc.faults import InjectedFaults, bind, parse_faults
from mshpc.launch.env import LaunchEnv
from mshpc.launch.rendezvous import DistInfo


def build_fault_hooks(env: LaunchEnv, info: DistInfo, run_dir: Path | None = None,
                      ckpt_root: Path | None = None) -> FaultHooks:
    """This rank's hooks: NO_FAULTS unless the spec plans a fault for its rank or node in this
    attempt. Every rank parses the whole spec, so a malformed one fails on all of them alike."""
    faults = parse_faults(env.test_faults)
    attempt = env.supervisor.attempt if env.supervisor else 0
    mine = bind(faults, info.rank, info.node, attempt, run_dir, ckpt_root)
    return InjectedFaults(mine, info.rank) if mine else NO_FAULTS
