"""GPU health through NVML (nvidia-ml-py, module `pynvml`): ECC counts, retired and remapped
rows, XID events, clocks and throttle reasons, temperature, power, PCIe link. Where NVML or the
driver is missing (CPU nodes, CI) every answer is "na" with the reason, never a pass."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mshpc.preflight.device import Target
from mshpc.preflight.record import Record

try:
    import pynvml
except ImportError:  # a declared dependency: a broken install is reported as "na", with this reason
    pynvml = None

log = logging.getLogger(__name__)

MISSING = object()  # a counter this GPU or driver does not report


@dataclass(frozen=True)
class Throttle:
    hw: bool  # HW slowdown, HW thermal slowdown or HW power brake: something is wrong
    sw_thermal: bool  # the driver slows the clocks for temperature
    temperature_c: float


class Nvml:
    """NVML for this process: `handle` is this rank's GPU, or None and `reason` says why."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.handle: Any = None
        self.reason = ""
        self._xids: Any = None

    def __enter__(self) -> Nvml:
        if pynvml is None:
            self.reason = "not available: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            return self
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:  # no driver: NVML_ERROR_LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED
            self.reason = f"not available: NVML: {exc}"
            return self
        try:
            if self.target.device.type != "cuda":
                self.reason = "not available: this rank has no GPU (NVML itself works)"
                return self
            self.handle = _handle(self.target.device)
        except pynvml.NVMLError as exc:
            self.reason = f"not available: NVML: {exc}"
        finally:
            if self.handle is None:
                pynvml.nvmlShutdown()
        self._watch_xids()
        return self

    def __exit__(self, *_: object) -> None:
        if self.handle is not None:
            pynvml.nvmlShutdown()

    def _watch_xids(self) -> None:
        try:
            self._xids = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(self.handle, pynvml.nvmlEventTypeXidCriticalError, self._xids)
        except pynvml.NVMLError as exc:
            log.info("XID events not watched on %s: %s", self.target.label, exc)
            self._xids = None

    def xids(self) -> list[int] | None:
        """Critical XIDs since __enter__ (None where the driver cannot watch them)."""
        if self._xids is None:
            return None
        seen = []
        while True:
            try:
                seen.append(int(pynvml.nvmlEventSetWait_v2(self._xids, 0).eventData))
            except pynvml.NVMLError_Timeout:
                return seen

    def throttle(self) -> Throttle | None:
        if self.handle is None:
            return None
        try:
            reasons = pynvml.nvmlDeviceGetCurrentClocksEventReasons(self.handle)
        except pynvml.NVMLError_FunctionNotFound:  # drivers before 535 have only the old name
            reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle)
        hw = (pynvml.nvmlClocksThrottleReasonHwSlowdown | pynvml.nvmlClocksThrottleReasonHwThermalSlowdown
              | pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown)
        temperature = pynvml.nvmlDeviceGetTemperature(self.handle, pynvml.NVML_TEMPERATURE_GPU)
        return Throttle(bool(reasons & hw), bool(reasons & pynvml.nvmlClocksThrottleReasonSwThermalSlowdown),
                        float(temperature))


def _handle(device: torch.device) -> Any:
    """The NVML handle of a torch device, by UUID: torch's numbering (after CUDA_VISIBLE_DEVICES)
    and NVML's differ. Without a UUID (old torch), by index, which holds when nothing is hidden."""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    if not uuid:
        log.warning("torch gives no GPU UUID: NVML's GPU %d is taken for %s", device.index, device)
        return pynvml.nvmlDeviceGetHandleByIndex(device.index)
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def _read(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except pynvml.NVMLError_NotSupported:
        return MISSING


def _counters(h: Any) -> dict[str, tuple[Any, str]]:
    """metric -> (value or MISSING, detail), read once each."""
    nv = pynvml
    remapped = _read(nv.nvmlDeviceGetRemappedRows, h)  # (corrected, uncorrected, pending, failure)
    width, max_width = _read(nv.nvmlDeviceGetCurrPcieLinkWidth, h), _read(nv.nvmlDeviceGetMaxPcieLinkWidth, h)
    power, limit = _read(nv.nvmlDeviceGetPowerUsage, h), _read(nv.nvmlDeviceGetEnforcedPowerLimit, h)
    clock = _read(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
    max_clock = _read(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)

    def ecc(kind: int, where: int) -> Any:
        return _read(nv.nvmlDeviceGetTotalEccErrors, h, kind, where)

    return {
        "temperature_c": (_read(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU), ""),
        "power_w": (power if power is MISSING else power / 1000,
                    "" if limit is MISSING else f"limit {limit / 1000:.0f} W"),
        "sm_clock_mhz": (clock, "" if max_clock is MISSING else f"max {max_clock} MHz"),
        "ecc_uncorrected_volatile": (ecc(nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC), "since boot"),
        "ecc_uncorrected_aggregate": (ecc(nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC), "lifetime"),
        "ecc_corrected_volatile": (ecc(nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC), "since boot"),
        "retired_pages_pending": (_read(nv.nvmlDeviceGetRetiredPagesPendingStatus, h), "1: a reset is needed"),
        "remapped_rows_pending": (MISSING if remapped is MISSING else int(remapped[2]), "1: a reset is needed"),
        "remapped_rows_failure": (MISSING if remapped is MISSING else int(remapped[3]), "1: remapping failed"),
        "pcie_width_ratio": (MISSING if MISSING in (width, max_width) else width / max_width,
                             f"x{width} of x{max_width}"),
        "pcie_gen_max": (_read(nv.nvmlDeviceGetMaxPcieLinkGeneration, h), "device and slot"),
        "pcie_gen_current": (_read(nv.nvmlDeviceGetCurrPcieLinkGeneration, h), "idle GPUs drop to a lower gen"),
    }


def health(nvml: Nvml) -> list[Record]:
    """One record per health metric for this rank's GPU, or one "na" record with the reason."""
    t = nvml.target
    if nvml.handle is None:
        return [Record("", t.label, "nvml", None, "", "na", detail=nvml.reason, kind=t.kind)]
    records = []
    for metric, (value, detail) in _counters(nvml.handle).items():
        if value is MISSING:
            records.append(Record("", t.label, metric, None, "", "na", kind=t.kind,
                                  detail="not supported by this GPU or driver"))
        else:
            records.append(Record("", t.label, metric, float(value), "", detail=detail, kind=t.kind))
    xids = nvml.xids()
    records.append(Record("", t.label, "xid_events", None if xids is None else float(len(xids)), "",
                          "na" if xids is None else "info", kind=t.kind,
                          detail="not watchable here" if xids is None else f"critical XIDs during the run: {xids}"))
    return records
