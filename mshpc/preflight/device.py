"""Device tests, per GPU with CUDA and per rank on CPU: dense GEMM throughput in the training
dtype, GEMM correctness against a float64 reference, device copy bandwidth, host<->device
bandwidth. One code path: a `Target` says which device, dtype and how to synchronise."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mshpc.preflight.record import Record

log = logging.getLogger(__name__)

# Device types that thresholds.yaml knows, matched in the device's name (most specific first).
KNOWN_GPUS = ("H200", "H100", "A100")
# Problem sizes per device class: big enough to reach the device's steady rate, small enough for
# the quick level. GEMM operands are integers in [-4, 4]: every product sum of an n-long row is
# exact in fp32 accumulation (|sum| <= 16 n < 2^24), so the float64 reference is exact.
GEMM_N = {"cuda": 8192, "cpu": 384}
COPY_BYTES = {"cuda": 1 << 30, "cpu": 32 << 20}
HOST_COPY_BYTES = 256 << 20


@dataclass(frozen=True)
class Target:
    device: torch.device
    kind: str  # thresholds.yaml device type: H100, H200, A100, CPU, or the GPU's own name
    name: str  # the full device name, for the report
    dtype: torch.dtype  # the training dtype: bf16 on GPU, fp32 on CPU
    label: str  # "cuda:3"; on CPU "cpu/rank 5", as ranks share the CPU

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def clock(self) -> float:
        """Seconds: wall time on GPU; on CPU, this process's CPU time, with the device tests on
        one thread (build_target), so that ranks sharing cores, or other tenants of the
        machine, do not measure each other; a slow core or memory still shows."""
        return time.perf_counter() if self.device.type == "cuda" else time.process_time()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def build_target(rank: int, local_rank: int) -> Target:
    """This rank's device: GPU number local_rank (mod the visible count), else the CPU."""
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # see Target.clock
        return Target(torch.device("cpu"), "CPU", _cpu_name(), torch.float32, f"cpu/rank {rank}")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)
    kind = next((k for k in KNOWN_GPUS if k in name.upper()), name)
    if kind == name:
        log.warning("no thresholds for %s: only the fleet rules judge it", name)
    return Target(device, kind, name, torch.bfloat16, str(device))


def best_rate(step: Callable[[], object], work: float, target: Target, reps: int, rep_s: float,
              slow_factor: int = 1) -> float:
    """Work per second of `step`, the best of `reps` repetitions of about `rep_s` seconds each.
    The best, not the mean: a noisy neighbour's burst must not fail a healthy device, while a
    slow device is slow in every repetition. `slow_factor` > 1 runs each step that many times
    and counts it once (the gemm_slow test fault)."""
    step()  # warm-up: kernels chosen, memory touched
    target.sync()
    start = target.clock()
    step()
    target.sync()
    iters = max(1, round(rep_s / max(target.clock() - start, 1e-6)))
    rates = []
    for _ in range(reps):
        start = target.clock()
        for _ in range(iters * slow_factor):
            step()
        target.sync()
        rates.append(work * iters / max(target.clock() - start, 1e-9))
    return max(rates)


def gemm_operands(target: Target, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(-4, 5, (n, n), generator=gen, dtype=torch.int32) for _ in range(2))
    return a.to(target.device, target.dtype), b.to(target.device, target.dtype)


def gemm_tflops(target: Target, reps: int, rep_s: float, slow_factor: int = 1) -> Record:
    n = GEMM_N[target.device.type]
    a, b = gemm_operands(target, n)
    out = torch.empty_like(a)
    rate = best_rate(lambda: torch.matmul(a, b, out=out), 2.0 * n**3, target, reps, rep_s, slow_factor)
    return Record("", target.label, "gemm_tflops", rate / 1e12, "TFLOP/s", kind=target.kind,
                  detail=f"{n}x{n}x{n} {str(target.dtype).removeprefix('torch.')}")


def gemm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact product, in float64 (on the GPU, by its FP64 units, not the tensor cores)."""
    return torch.matmul(a.double(), b.double())


def rel_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """max |result - reference| / max(|reference|, 1), over every element."""
    diff = (result.double() - reference).abs() / reference.abs().clamp(min=1.0)
    return float(diff.max())


def corrupt(result: torch.Tensor) -> None:
    """The gemm_wrong test fault: one element of the product is wrong, as silent corruption is."""
    flat = result.view(-1)
    flat[flat.numel() // 3] = flat[flat.numel() // 3] * 8 + 8


def gemm_correctness(target: Target, wrong: bool = False) -> Record:
    a, b = gemm_operands(target, GEMM_N[target.device.type], seed=1)
    result = torch.matmul(a, b)
    if wrong:
        corrupt(result)
    error = rel_error(result, gemm_reference(a, b))
    return Record("", target.label, "gemm_rel_error", error, "", kind=target.kind,
                  detail="max |C - C_ref| / max(|C_ref|, 1) against float64")


def copy_gbps(target: Target, reps: int, rep_s: float) -> Record:
    nbytes = COPY_BYTES[target.device.type]
    src = torch.ones(nbytes // 4, device=target.device)
    dst = torch.empty_like(src)
    # a copy reads and writes every byte, as STREAM's Copy counts it
    rate = best_rate(lambda: dst.copy_(src), 2.0 * nbytes, target, reps, rep_s)
    return Record("", target.label, "copy_gbps", rate / 1e9, "GB/s", kind=target.kind,
                  detail=f"{nbytes >> 20} MiB device copy, read + write")


def host_copy_gbps(target: Target, reps: int, rep_s: float) -> list[Record]:
    """Pinned host -> device and device -> host bandwidth; not available on a CPU rank."""
    tests = ("h2d_gbps", "d2h_gbps")
    if target.device.type != "cuda":
        return [Record("", target.label, t, None, "GB/s", "na", kind=target.kind,
                       detail="not available: no GPU (host-device copies need CUDA)") for t in tests]
    host = torch.ones(HOST_COPY_BYTES // 4, pin_memory=True)
    dev = torch.empty(HOST_COPY_BYTES // 4, device=target.device)
    h2d = best_rate(lambda: dev.copy_(host, non_blocking=True), HOST_COPY_BYTES, target, reps, rep_s)
    d2h = best_rate(lambda: host.copy_(dev, non_blocking=True), HOST_COPY_BYTES, target, reps, rep_s)
    detail = f"{HOST_COPY_BYTES >> 20} MiB, pinned"
    return [Record("", target.label, t, rate / 1e9, "GB/s", kind=target.kind, detail=detail)
            for t, rate in zip(tests, (h2d, d2h), strict=True)]
