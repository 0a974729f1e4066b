"""Admin mode's drain on the real local Slurm, as the supervisor (an evicted node) and preflight
(a failing node) call it: our reason is set, another tool's reason is left alone, and one of ours
may be replaced by a newer one."""

import subprocess

import pytest

from mshpc.launch.drain import current_reason, drain

pytestmark = pytest.mark.slurm
NODE = "n3"


def scontrol(*args: str) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={NODE}", *args], check=True, capture_output=True, timeout=30)


def test_drain_sets_an_mshpc_reason_and_never_overwrites_another(slurm_cluster):
    if current_reason(NODE) is not None:
        pytest.skip(f"{NODE} has a reason set by someone else ({current_reason(NODE)!r}); not touching it")
    try:
        scontrol("State=DRAIN", "Reason=healthcheck: ECC errors on GPU 3")
        assert drain(NODE, "mshpc: blamed twice") == \
            f"not draining {NODE}: it has another reason already ('healthcheck: ECC errors on GPU 3')"
        assert current_reason(NODE) == "healthcheck: ECC errors on GPU 3"
        scontrol("State=RESUME")
        assert current_reason(NODE) is None
        assert drain(NODE, "mshpc: rank 1 killed by SIGKILL twice") == f"drained {NODE}: mshpc: rank 1 killed by SIGKILL twice"
        assert current_reason(NODE) == "mshpc: rank 1 killed by SIGKILL twice"
        # A later preflight failure replaces the supervisor's reason: both are ours.
        assert drain(NODE, "mshpc-preflight: gemm_rel_error cuda:1 7.9") == \
            f"drained {NODE}: mshpc-preflight: gemm_rel_error cuda:1 7.9"
        assert current_reason(NODE) == "mshpc-preflight: gemm_rel_error cuda:1 7.9"
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={NODE}", "State=RESUME"], capture_output=True, timeout=30)
