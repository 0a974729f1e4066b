"""Algorithm and bus bandwidth of a collective, with nccl-tests' formulas
(NVIDIA/nccl-tests, doc/PERFORMANCE.md; src/*.cu `*GetBw`).

`size_bytes` is the size nccl-tests prints: the all-reduce buffer; the whole gathered output of
an all-gather; the whole input of a reduce-scatter; the whole send buffer of an all-to-all; the
buffer a rank sends in send/recv. algbw = size / time; busbw = algbw x the factor below, which
makes every collective comparable to the link's peak bandwidth whatever the rank count n.
"""

from __future__ import annotations

from mshpc.errors import ConfigError


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `op` on n ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n  # reduce-scatter then all-gather: each rank moves 2(n-1)/n of it
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n  # each rank moves all but its own 1/n
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ConfigError(f"no bus bandwidth formula for collective {op!r} (choose all_reduce, all_gather, "
                      "reduce_scatter, all_to_all, broadcast, reduce or sendrecv)")


def algbw_gbps(size_bytes: int, time_s: float) -> float:
    """GB/s (1e9 bytes, as nccl-tests prints) of one operation of `size_bytes` in `time_s`."""
    return size_bytes / time_s / 1e9


def busbw_gbps(op: str, size_bytes: int, time_s: float, n: int) -> float:
    return algbw_gbps(size_bytes, time_s) * bus_factor(op, n)
