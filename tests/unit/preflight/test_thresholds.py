"""The shipped thresholds per device type, and a user's file merged over them."""

import pytest

from mshpc.errors import ConfigError
from mshpc.preflight.thresholds import Rule, load_thresholds


def test_shipped_thresholds_cover_each_device_type():
    th = load_thresholds()
    for kind in ("H100", "H200", "A100", "CPU"):
        rule, whose = th.absolute(kind, "gemm_tflops")
        assert rule.fail is not None and whose == kind
    assert th.absolute("H100", "gemm_tflops")[0].fail > th.absolute("A100", "gemm_tflops")[0].fail
    assert th.absolute("CPU", "ecc_uncorrected_volatile") == (Rule(fail=0.0), "all devices")
    assert th.fleet["gemm_tflops"] == Rule(fail=0.8, warn=0.9)
    assert th.absolute("Some GPU", "gemm_tflops") is None  # unknown types: only the fleet rules


def test_a_user_file_overrides_single_entries(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("fleet:\n  gemm_tflops: {fail: 0.5}\ndevices:\n  H100:\n    gemm_tflops: {fail: 600, warn: 650}\n"
                    "  L40S:\n    gemm_tflops: {fail: 200}\n")
    th = load_thresholds(path)
    assert th.fleet["gemm_tflops"] == Rule(fail=0.5)  # a metric's rule is replaced whole
    assert th.fleet["copy_gbps"] == Rule(fail=0.8, warn=0.9)  # the rest stays
    assert th.absolute("H100", "gemm_tflops")[0] == Rule(fail=600, warn=650)
    assert th.absolute("H100", "copy_gbps")[0].fail == 2000
    assert th.absolute("L40S", "gemm_tflops") == (Rule(fail=200), "L40S")


@pytest.mark.parametrize("text, message", [
    ("fleet:\n  gemm_tflop: {fail: 0.5}\n", "unknown metric 'gemm_tflop' \\(valid: gemm_tflops"),
    ("fleet:\n  gemm_tflops: {fial: 0.5}\n", "must look like"),
    ("limits: {}\n", "unknown section\\(s\\) limits \\(valid: devices, common, fleet\\)"),
    ("fleet: [\n", "not valid YAML"),
])
def test_a_bad_file_says_what_and_where(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_thresholds(path)


def test_a_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_thresholds(tmp_path / "nope.yaml")
