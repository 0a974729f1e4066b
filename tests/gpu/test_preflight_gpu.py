"""The GPU paths of `mshpc preflight`: bf16 GEMM and its float64 check on the device, device and
host<->device copies, NVML's readings and throttle sampling during a burn, and the quick level on
every GPU of the machine. Skipped, with the reason, where there is no GPU."""

import json

import pytest
import torch

from support.cli_runner import mshpc
from mshpc.preflight import device as dev
from mshpc.preflight.burn import burn
from mshpc.preflight.nvml import Nvml, health

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


@pytest.fixture(scope="module")
def target() -> dev.Target:
    return dev.build_target(0, 0)


def test_gpu_target_trains_in_bf16(target):
    assert target.device.type == "cuda" and target.dtype == torch.bfloat16
    assert target.kind in dev.KNOWN_GPUS or target.kind == target.name


def test_bf16_gemm_runs_and_its_check_catches_one_wrong_element(target):
    assert dev.gemm_tflops(target, reps=2, rep_s=0.1).value > 1.0  # any tensor-core GPU: far above 1
    good = dev.gemm_correctness(target)
    assert good.value < 0.02  # bf16 output rounding only
    assert dev.gemm_correctness(target, wrong=True).value > 1.0


def test_copies_measure_device_and_pcie_bandwidth(target):
    assert dev.copy_gbps(target, reps=2, rep_s=0.1).value > 50
    h2d, d2h = dev.host_copy_gbps(target, reps=2, rep_s=0.1)
    assert (h2d.test, d2h.test) == ("h2d_gbps", "d2h_gbps") and h2d.value > 1 and d2h.value > 1


def test_nvml_reads_health_and_samples_throttling_in_a_burn(target):
    with Nvml(target) as nvml:
        if nvml.handle is None:
            pytest.skip(f"NVML unusable here: {nvml.reason}")
        records = {r.test: r for r in health(nvml)}
        assert "nvml" not in records and records["temperature_c"].value > 0
        assert records["pcie_width_ratio"].status in ("info", "na")
        burned = {r.test: r for r in burn(target, nvml, seconds=2.0)}
    assert burned["burn_errors"].value == 0 and burned["burn_tflops"].value > 1.0
    assert burned["burn_max_temperature_c"].value > 0 and burned["burn_hw_throttle_fraction"].status == "info"


def test_quick_level_on_every_gpu_of_this_machine(tmp_path):
    out = mshpc("preflight", "--level", "quick", "--json", str(tmp_path / "v.json"), timeout_s=600)
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["ranks"] == torch.cuda.device_count()
    assert out.returncode == (3 if doc["status"] == "fail" else 0), out.stdout[-3000:]
    assert {r["test"] for r in doc["records"]} >= {"gemm_tflops", "gemm_rel_error", "copy_gbps", "h2d_gbps",
                                                   "temperature_c", "ecc_uncorrected_volatile"}
