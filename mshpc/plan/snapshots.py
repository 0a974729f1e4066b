"""What recovery in place's in-memory snapshots cost a layout (`recovery.*`, mshpc/snapshot/):
per rank, the bytes of one snapshot (its ZeRO shard's fp32 master and two moments: 12 bytes per
parameter over dp, routed experts over dp / ep, as memory.py counts the optimizer), the host
memory they take (two slots of its own, double-buffered, and two it keeps for its buddy's ward),
and the time their traffic takes as a share of the step: the copy off the device (PCIe, overlapped
with the next step) and the send to the buddy on another node (the inter-node link, which the
step's dp traffic shares).
"""

from __future__ import annotations

from dataclasses import dataclass

from mshpc.config import ModelConfig
from mshpc.plan.devices import DeviceSpec
from mshpc.plan.layout import Layout
from mshpc.plan.memory import SHARDED_STATE_BYTES, sharded_params, stage_params

SLOTS = 4  # two of its own and two of its ward's: mshpc/snapshot/store.py, exchange.py


@dataclass(frozen=True)
class SnapshotCost:
    """One rank's, on the fullest pipeline stage."""

    snapshot_bytes: float  # one snapshot
    host_bytes: float  # host memory every rank keeps for snapshots
    d2h_s: float  # copying one off the device
    send_s: float  # sending one to the buddy
    step_fraction: float  # the busier of the two links' share of the steps between snapshots

    def to_json(self, gib: float) -> dict[str, float]:
        return {"snapshot_gib": self.snapshot_bytes / gib, "host_gib": self.host_bytes / gib,
                "d2h_s": self.d2h_s, "send_s": self.send_s, "step_fraction": self.step_fraction}


def snapshot_cost(m: ModelConfig, layout: Layout, dev: DeviceSpec, step_s: float, interval_steps: int) -> SnapshotCost:
    """The snapshot cost of `layout` whose step takes `step_s`, a snapshot every `interval_steps`."""
    # the optimizer's shard as memory.py counts it: routed experts over dp / ep, the rest over dp
    nbytes = max(sharded_params(m, layout, stage_params(m, layout, s)) for s in {0, layout.pp - 1}) * SHARDED_STATE_BYTES
    d2h_s = nbytes / (dev.d2h_gbps * 1e9)
    send_s = nbytes / (dev.inter_gbps * 1e9)
    return SnapshotCost(nbytes, SLOTS * nbytes, d2h_s, send_s, max(d2h_s, send_s) / (interval_steps * step_s))
