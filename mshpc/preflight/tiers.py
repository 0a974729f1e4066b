"""The three levels of the suite, and what each runs in its time budget.

quick: < 60 s per node (Slurm HealthCheckProgram, prolog): every device test briefly, NVML
health, each collective at one size, one exchange per node pair. standard (a few minutes): the
same longer and over a range of sizes, plus a sustained burn. extended (burn-in): a long burn
and the full size range. Sizes and counts differ by device class; CPU ranks get small ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from mshpc.errors import ConfigError

KiB, MiB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Tier:
    name: str
    budget_s: float  # stages still to run once this is spent are skipped, each with a record
    device_reps: int  # repetitions of each device test (the best one counts)
    device_rep_s: float  # seconds per repetition
    burn_s: dict[str, float]  # sustained burn per device class ("cuda", "cpu"); 0: none
    sizes: dict[str, tuple[int, ...]]  # collective sizes (nccl-tests' sense) per device class
    warmup: dict[str, int]  # untimed collective runs per size (nccl-tests -w)
    iters: dict[str, int]  # timed runs per size (nccl-tests -n)
    pair_bytes: dict[str, int]  # message size of the pairwise link test
    confirm_samples: int = 3  # a slow rate excludes a node only if this many samples all fail (confirm.py)
    confirm_pause_s: float = 1.0  # before each re-measurement, so that one burst of load is not all samples


TIERS = {
    "quick": Tier("quick", 60.0, 3, 0.1, {"cuda": 0.0, "cpu": 0.0},
                  {"cuda": (64 * MiB,), "cpu": (1 * MiB,)}, {"cuda": 5, "cpu": 1}, {"cuda": 20, "cpu": 3},
                  # CPU pairs: 4 MiB, so that 3 timed exchanges last longer than a few scheduler
                  # ticks on a shared host (1 MiB measured the scheduler: 0.07 to 1.2 GB/s in one run)
                  {"cuda": 64 * MiB, "cpu": 4 * MiB}),
    "standard": Tier("standard", 300.0, 5, 0.25, {"cuda": 30.0, "cpu": 2.0},
                     {"cuda": (1 * MiB, 16 * MiB, 256 * MiB, 1024 * MiB), "cpu": (64 * KiB, 1 * MiB, 4 * MiB)},
                     {"cuda": 5, "cpu": 1}, {"cuda": 20, "cpu": 3}, {"cuda": 256 * MiB, "cpu": 4 * MiB}),
    "extended": Tier("extended", 3600.0, 10, 1.0, {"cuda": 600.0, "cpu": 20.0},
                     {"cuda": tuple(8 * KiB << (2 * i) for i in range(10)),  # 8 KiB .. 2 GiB, x4
                      "cpu": (4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB)},
                     {"cuda": 5, "cpu": 2}, {"cuda": 50, "cpu": 5}, {"cuda": 1024 * MiB, "cpu": 16 * MiB}),
}
LEVELS = tuple(TIERS)


def tier(level: str) -> Tier:
    if level not in TIERS:
        raise ConfigError(f"preflight level {level!r} is not a level (choose {', '.join(LEVELS)})")
    return TIERS[level]
