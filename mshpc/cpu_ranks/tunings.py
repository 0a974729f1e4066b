"""The seam's one choice: which CPU-rank tunings this process runs, made once at start-up from
where the rank computes (before its model and optimizer are built), installed, and logged in one
line. A GPU rank runs none: NCCL's collectives, private buckets, the allocator and torch's
optimizer as they are."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mshpc.cpu_ranks.eager_optimizer import enable_eager_optimizer
from mshpc.cpu_ranks.gloo_p2p import GlooPointToPoint
from mshpc.cpu_ranks.heap import keep_freed_host_memory, user_tuned_allocator
from mshpc.parallel import comm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuTunings:
    """What this process runs of mshpc/cpu_ranks."""

    p2p_collectives: bool  # comm's reduce-scatter and all-gather through gloo_p2p.py
    # ZeRO may map its buckets in /dev/shm (parallel.dp_shared_memory decides), and a snapshot's
    # buddy on the same host maps its slots (mshpc/snapshot/exchange.py)
    shared_buckets: bool
    heap_kept: bool  # glibc keeps freed memory (heap.py); False where the user tuned the allocator
    eager_optimizer: bool  # the optimizers skip torch._dynamo's import (eager_optimizer.py)

    def describe(self) -> str:
        if not (self.p2p_collectives or self.heap_kept):
            return "GPU rank: torch's collectives, private buckets, no CPU-rank tunings"
        heap = "freed heap kept" if self.heap_kept else f"heap left alone ({user_tuned_allocator()})"
        return ("CPU rank tunings (mshpc/cpu_ranks): gloo reduce-scatter and all-gather point-to-point, "
                f"ZeRO buckets in shared memory where parallel.dp_shared_memory (and snapshots where a buddy "
                f"shares the host), {heap}, "
                "optimizers without torch._dynamo")


NONE = CpuTunings(p2p_collectives=False, shared_buckets=False, heap_kept=False, eager_optimizer=False)
_active = NONE


def select_cpu_tunings(device: torch.device) -> CpuTunings:
    """Choose and install this process's tunings: all of them for a rank that computes on CPU
    (its groups are gloo), none otherwise; logged once. Call at start-up, before the model."""
    global _active
    if device.type != "cpu":
        _active = NONE
    else:
        comm.use_transport(GlooPointToPoint())
        enable_eager_optimizer()
        _active = CpuTunings(p2p_collectives=True, shared_buckets=True, heap_kept=keep_freed_host_memory(),
                             eager_optimizer=True)
    log.info("%s", _active.describe())
    return _active


def active() -> CpuTunings:
    """The tunings start-up chose (NONE before any choice)."""
    return _active
