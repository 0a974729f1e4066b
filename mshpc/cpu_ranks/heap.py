"""Keep freed host memory in the process, so a training step does not page-fault it back in.

A CPU rank frees and re-allocates the same few MB buffers every step (the gloo reduce-scatter's
receive buffers, activations, gradients). glibc returns the top of its heap to the OS whenever
more than 128 KiB lies free there, and hands tensors over its adaptive mmap threshold fresh
mmaps, so the next step faults those pages back in and the kernel clears them: about 3,000
faults a step on 2 ranks at the tiny shape, 120,000 at gpt-125m (benchmarks/host_memory.py,
compile_vs_ddp.py). Raising both thresholds keeps that memory in the heap for reuse.

Setting the trim threshold alone is a trap: any fixed threshold turns off glibc's adaptive mmap
threshold, and every tensor over 128 KiB then becomes its own mmap. So both are set, together.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD_BYTES = 1 << 30  # up to 1 GiB free at the heap's top stays for the next step
MMAP_THRESHOLD_BYTES = 256 << 20  # blocks below 256 MiB come from the reusable heap

_applied = False


def user_tuned_allocator() -> str | None:
    """Why the allocator is the user's to tune (an env setting, another allocator), or None."""
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        if name in os.environ:
            return f"{name} is set"
    if "malloc" in os.environ.get("LD_PRELOAD", ""):
        return "another allocator is preloaded"
    if platform.libc_ver()[0] != "glibc":
        return "not glibc"
    return None


def keep_freed_host_memory() -> bool:
    """Raise glibc's trim and mmap thresholds once per process; True if they are now set.
    Leaves the allocator alone where the user tuned it (see user_tuned_allocator)."""
    global _applied
    if _applied:
        return True
    if user_tuned_allocator() is not None:
        return False
    mallopt = ctypes.CDLL(None).mallopt
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    return _applied


def freed_host_memory_kept() -> bool:
    """Whether keep_freed_host_memory set the thresholds in this process."""
    return _applied
