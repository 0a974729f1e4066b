"""The test-only fault spec (MSHPC_TEST_FAULTS): the preflight kinds carry no step."""

import pytest

from mshpc.errors import ConfigError
from mshpc.faults import Fault, parse_faults, planned


def test_preflight_faults_name_a_rank_and_no_step():
    faults = parse_faults("gemm_slow:rank=1; gemm_wrong:rank=2;raise:rank=0:step=3")
    assert faults == (Fault("gemm_slow", 1, 0), Fault("gemm_wrong", 2, 0), Fault("raise", 0, 3))
    assert planned(faults, "gemm_slow", 1) and not planned(faults, "gemm_slow", 2)
    assert planned(faults, "gemm_wrong", 2) and not planned(faults, "gemm_wrong", 0)


@pytest.mark.parametrize("spec", ["gemm_slow:rank=1:step=2", "raise:rank=1", "gemm_fast:rank=1"])
def test_a_malformed_fault_is_a_config_error(spec):
    with pytest.raises(ConfigError, match="MSHPC_TEST_FAULTS"):
        parse_faults(spec)
