"""The limits a measurement is held against: per device type (H100, H200, A100, CPU), for every
device (correctness and health counters), and relative to the fleet median. Shipped in
thresholds.yaml beside this file; a user's YAML of the same shape overrides any entry."""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from mshpc.errors import ConfigError

Better = Literal["higher", "lower"] | None  # None: reported, never judged

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv")
SCOPES = ("intra", "inter", "world")  # within a node, across nodes (one rank per node), all ranks

# metric -> (unit, which direction is better)
METRICS: dict[str, tuple[str, Better]] = {
    "gemm_tflops": ("TFLOP/s", "higher"), "gemm_rel_error": ("", "lower"),
    "copy_gbps": ("GB/s", "higher"), "h2d_gbps": ("GB/s", "higher"), "d2h_gbps": ("GB/s", "higher"),
    "burn_tflops": ("TFLOP/s", "higher"), "burn_min_ratio": ("", "higher"), "burn_errors": ("", "lower"),
    "burn_hw_throttle_fraction": ("", "lower"), "burn_sw_thermal_fraction": ("", "lower"),
    "burn_max_temperature_c": ("C", "lower"),
    "nvml": ("", None), "temperature_c": ("C", "lower"), "power_w": ("W", None), "sm_clock_mhz": ("MHz", None),
    "ecc_uncorrected_volatile": ("", "lower"), "ecc_uncorrected_aggregate": ("", "lower"),
    "ecc_corrected_volatile": ("", "lower"), "retired_pages_pending": ("", "lower"),
    "remapped_rows_failure": ("", "lower"), "remapped_rows_pending": ("", "lower"), "xid_events": ("", "lower"),
    "pcie_width_ratio": ("", "higher"), "pcie_gen_max": ("", "higher"), "pcie_gen_current": ("", None),
    **{f"{scope}_{op}_busbw_gbps": ("GB/s", "higher") for scope in SCOPES for op in OPS},
    **{f"{op}_wrong_elements": ("", "lower") for op in OPS},
    "pair_gbps": ("GB/s", "higher"), "pair_wrong_elements": ("", "lower"), "link_gbps": ("GB/s", "higher"),
    "stage": ("", None),
}

SHIPPED = "thresholds.yaml"


@dataclass(frozen=True)
class Rule:
    fail: float | None = None
    warn: float | None = None


def beyond(value: float, limit: float | None, better: str) -> bool:
    """Whether `value` is on the wrong side of `limit` (None: no limit)."""
    if limit is None:
        return False
    return value < limit if better == "higher" else value > limit


def failed_samples(samples: list[float], limit: float | None, better: str) -> int:
    return sum(beyond(s, limit, better) for s in samples)


@dataclass(frozen=True)
class Thresholds:
    devices: dict[str, dict[str, Rule]]  # device type -> metric -> rule
    common: dict[str, Rule]  # every device type
    fleet: dict[str, Rule]  # ratios to the fleet median

    def absolute(self, kind: str, test: str) -> tuple[Rule, str] | None:
        """The rule for `test` on a device of type `kind`, and whose rule it is."""
        if test in self.devices.get(kind, {}):
            return self.devices[kind][test], kind
        if test in self.common:
            return self.common[test], "all devices"
        return None


def _rules(where: str, data: Any) -> dict[str, Rule]:
    if not isinstance(data, dict):
        raise ConfigError(f"thresholds {where} must be a mapping of metric: {{fail: x, warn: y}}")
    rules = {}
    for metric, rule in data.items():
        if metric not in METRICS:
            raise ConfigError(f"thresholds {where}: unknown metric {metric!r} (valid: {', '.join(METRICS)})")
        if not isinstance(rule, dict) or set(rule) - {"fail", "warn"} or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in rule.values()):
            raise ConfigError(f"thresholds {where}.{metric}={rule!r} must look like {{fail: 0.8, warn: 0.9}}")
        rules[metric] = Rule(**{k: float(v) for k, v in rule.items()})
    return rules


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        both_maps = isinstance(value, dict) and isinstance(merged.get(key), dict) and key not in METRICS
        merged[key] = _merge(merged[key], value) if both_maps else value
    return merged


def _read(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML ({str(exc).splitlines()[0]})") from None
    unknown = set(data) - {"devices", "common", "fleet"} if isinstance(data, dict) else {"(not a mapping)"}
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {', '.join(sorted(unknown))} (valid: devices, common, fleet)")
    return data


def load_thresholds(override: str | Path | None = None) -> Thresholds:
    """The shipped thresholds, with `override` (a YAML file of the same shape) merged over them."""
    data = _read(importlib.resources.files("mshpc.preflight").joinpath(SHIPPED).read_text(), SHIPPED)
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise ConfigError(f"preflight.thresholds file {str(path)!r} does not exist")
        data = _merge(data, _read(path.read_text(), str(path)))
    devices = data.get("devices") or {}
    if not isinstance(devices, dict):
        raise ConfigError("thresholds devices must map a device type (H100, CPU, ...) to its metrics")
    return Thresholds(
        devices={kind: _rules(f"devices.{kind}", rules) for kind, rules in devices.items()},
        common=_rules("common", data.get("common") or {}),
        fleet=_rules("fleet", data.get("fleet") or {}),
    )
