"""A 90% interval for a ratio of medians, by resampling rounds in pairs: the contenders of a round
ran side by side (or one right after the other), so a slow moment of the shared machine falls on
both, and steps within one run are not independent draws (a whole run is now and then ~10% slow)."""

from __future__ import annotations

import random
import statistics


def paired_round_interval(top: list[list[float]], bottom: list[list[float]],
                          draws: int = 2000) -> tuple[float, float]:
    """5th and 95th percentiles of median(top's pooled samples) / median(bottom's) over `draws`
    resamplings of the round pairs (top[i], bottom[i]); each round holds one or more samples."""
    rng = random.Random(0)
    pairs = list(zip(top, bottom, strict=True))
    ratios = []
    for _ in range(draws):
        drawn = rng.choices(pairs, k=len(pairs))
        ratios.append(statistics.median(s for t, _ in drawn for s in t) / statistics.median(s for _, b in drawn for s in b))
    ratios.sort()
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]
