"""A sustained GEMM burn: throughput second by second, each second's result checked against the
float64 reference, and (on GPU) NVML's throttle reasons and temperature sampled as it heats up.
A healthy device holds its rate; a failing one throttles, slows down or computes wrong."""

from __future__ import annotations

import statistics

import torch

from mshpc.preflight.device import GEMM_N, Target, corrupt, gemm_operands, gemm_reference, rel_error
from mshpc.preflight.nvml import Nvml, Throttle
from mshpc.preflight.record import Record

INTERVAL_S = 1.0
# a wrong element beyond this relative error counts as an error (bf16 output rounds at 2^-9)
ERROR_TOLERANCE = 0.02


def _gemms_per_interval(target: Target, step: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> int:
    torch.matmul(a, b, out=step)
    target.sync()
    start = target.clock()
    torch.matmul(a, b, out=step)
    target.sync()
    return max(1, round(INTERVAL_S / max(target.clock() - start, 1e-6)))


def burn(target: Target, nvml: Nvml, seconds: float, slow_factor: int = 1, wrong: bool = False) -> list[Record]:
    """Run GEMMs for about `seconds` (of Target.clock); records of rate, stability, errors and
    throttling."""
    n = GEMM_N[target.device.type]
    a, b = gemm_operands(target, n, seed=2)
    reference = gemm_reference(a, b)
    out = torch.empty_like(a)
    iters = _gemms_per_interval(target, out, a, b)
    rates: list[float] = []
    errors, samples = 0, []
    deadline = target.clock() + seconds
    while target.clock() < deadline or not rates:
        start = target.clock()
        for _ in range(iters * slow_factor):  # slow_factor > 1: the gemm_slow test fault
            torch.matmul(a, b, out=out)
        target.sync()
        rates.append(2.0 * n**3 * iters / max(target.clock() - start, 1e-9))
        if wrong:
            corrupt(out)
        errors += rel_error(out, reference) > ERROR_TOLERANCE
        if (sample := nvml.throttle()) is not None:
            samples.append(sample)
    return _records(target, nvml, rates, errors, samples, seconds)


def _records(target: Target, nvml: Nvml, rates: list[float], errors: int, samples: list[Throttle],
             seconds: float) -> list[Record]:
    median = statistics.median(rates)

    def rec(test: str, value: float | None, detail: str, status: str = "info") -> Record:
        return Record("", target.label, test, value, "", status, kind=target.kind, detail=detail)

    records = [
        rec("burn_tflops", median / 1e12, f"median of {len(rates)} x {INTERVAL_S:g} s, {seconds:g} s burn"),
        rec("burn_min_ratio", min(rates) / median, "slowest second / median"),
        rec("burn_errors", float(errors), f"seconds whose GEMM result was wrong, of {len(rates)}"),
    ]
    if not samples:
        why = nvml.reason or "no samples"
        return records + [rec(t, None, why, "na") for t in
                          ("burn_hw_throttle_fraction", "burn_sw_thermal_fraction", "burn_max_temperature_c")]
    return records + [
        rec("burn_hw_throttle_fraction", sum(s.hw for s in samples) / len(samples), "HW slowdown/thermal/power brake"),
        rec("burn_sw_thermal_fraction", sum(s.sw_thermal for s in samples) / len(samples), "SW thermal slowdown"),
        rec("burn_max_temperature_c", max(s.temperature_c for s in samples), f"of {len(samples)} samples"),
    ]
