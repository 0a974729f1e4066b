"""What the planner assumes of a GPU and its links: one row per device type.

Peaks come from the diagnosis' table (mshpc.diagnose.mfu.PEAK_TFLOPS). Bandwidths are the bus
bandwidths NCCL reaches in nccl-tests on such systems, not the link's line rate: NVLink within a
node (A100: 600 GB/s bidirectional NVLink3, ~230 GB/s all-reduce busbw; H100/H200: 900 GB/s
NVLink4, ~360 GB/s), and one InfiniBand NIC per GPU across nodes (A100 systems: HDR 200 Gb/s,
H100/H200 systems: NDR 400 Gb/s; ~90% of line rate). `gemm_efficiency` is the fraction of the
peak that large bf16 GEMMs reach (cuBLAS on A100 ~0.80, on H100 ~0.72), which the planner uses
for all model FLOPs: preflight's GEMM test measures it on a real node (`--efficiency`).
`d2h_gbps` is a pinned device-to-host copy over the GPU's PCIe link, about 80% of its line rate
(A100: PCIe 4.0 x16, 32 GB/s a direction; H100/H200 SXM: PCIe 5.0 x16, 64 GB/s): what an
in-memory snapshot (mshpc/plan/snapshots.py) is copied off the device at.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mshpc.diagnose.mfu import PEAK_TFLOPS
from mshpc.errors import ConfigError


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops: float  # dense bf16
    memory_gib: float
    hbm_gbps: float  # device memory bandwidth, GB/s
    intra_gbps: float  # NCCL busbw within a node, GB/s
    inter_gbps: float  # NCCL busbw across nodes per GPU, GB/s
    gemm_efficiency: float
    act_bytes: int = 2  # bytes per activation element in the training dtype (bf16)
    d2h_gbps: float = 25.0  # pinned device-to-host copies, GB/s


DEVICES: dict[str, DeviceSpec] = {
    "a100": DeviceSpec("A100", PEAK_TFLOPS[("A100", "bf16")], 80.0, 2039.0, 230.0, 22.5, 0.80, d2h_gbps=25.0),
    "h100": DeviceSpec("H100", PEAK_TFLOPS[("H100", "bf16")], 80.0, 3350.0, 360.0, 45.0, 0.72, d2h_gbps=50.0),
    "h200": DeviceSpec("H200", PEAK_TFLOPS[("H200", "bf16")], 141.0, 4800.0, 360.0, 45.0, 0.72, d2h_gbps=50.0),
}


def device_spec(
    name: str, intra_gbps: float | None = None, inter_gbps: float | None = None,
    efficiency: float | None = None,
) -> DeviceSpec:
    """The table's row for `name`, with any of its bandwidths or efficiency overridden."""
    spec = DEVICES.get(name.lower())
    if spec is None:
        raise ConfigError(f"unknown GPU {name!r} (choose {', '.join(DEVICES)})")
    for label, value in (("--intra-bw", intra_gbps), ("--inter-bw", inter_gbps), ("--efficiency", efficiency)):
        if value is not None and value <= 0:
            raise ConfigError(f"{label}={value} must be > 0")
    if efficiency is not None and efficiency > 1:
        raise ConfigError(f"--efficiency={efficiency} must be a fraction of the peak (<= 1)")
    return replace(
        spec,
        intra_gbps=intra_gbps or spec.intra_gbps,
        inter_gbps=inter_gbps or spec.inter_gbps,
        gemm_efficiency=efficiency or spec.gemm_efficiency,
    )
