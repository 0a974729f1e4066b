"""NVML where there is none (a CPU machine, CI): "not available" with NVML's own reason."""

import pytest
import torch

from mshpc.preflight.device import build_target
from mshpc.preflight.nvml import Nvml, health


def test_without_a_driver_health_is_not_available_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu/test_preflight_gpu.py checks NVML's readings")
    with Nvml(build_target(0, 0)) as nvml:
        records = health(nvml)
        assert nvml.throttle() is None and nvml.xids() is None
    assert [(r.test, r.status, r.value) for r in records] == [("nvml", "na", None)]
    assert records[0].detail.startswith("not available: NVML: ")  # e.g. "NVML Shared Library Not Found"
