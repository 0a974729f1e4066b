"""Admin mode's drain on the real local Slurm: an evicted node is drained with an mshpc reason,
and a reason another tool set is left alone."""

import subprocess

import pytest

from mshpc.launch.drain import drain, node_reason

pytestmark = pytest.mark.slurm
NODE = "n3"


def scontrol(*args: str) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={NODE}", *args], check=True, timeout=30)


def test_drain_sets_an_mshpc_reason_and_never_overwrites_another(slurm_cluster):
    try:
        scontrol("State=DRAIN", "Reason=healthcheck: ECC errors on GPU 3")
        assert drain(NODE, "blamed twice") == f"skipped: {NODE} has another reason (healthcheck: ECC errors on GPU 3)"
        assert node_reason(NODE) == "healthcheck: ECC errors on GPU 3"
        scontrol("State=RESUME")
        assert node_reason(NODE) == ""
        assert drain(NODE, "rank 1 killed by SIGKILL twice") == "drained: mshpc: rank 1 killed by SIGKILL twice"
        assert node_reason(NODE) == "mshpc: rank 1 killed by SIGKILL twice"
        assert drain(NODE, "again") == "drained: mshpc: again"  # our own reason may be replaced
    finally:
        scontrol("State=RESUME")
