"""The restore planner's index finds exactly the entries CheckpointReader's scan finds."""

import random
from pathlib import Path

from mshpc.checkpoint.group_read import EntryIndex, plan_reads
from mshpc.checkpoint.manifest import Manifest, TensorEntry
from mshpc.checkpoint.reader import CheckpointReader


def manifest(cuts: list[int], total: int) -> Manifest:
    bounds = [0, *cuts, total]
    entries = [TensorEntry("master/w", (total,), "float32", f"shard-{i:05d}.h5", "master/w", lo, hi - lo, 0, 4096)
               for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    random.Random(1).shuffle(entries)  # the manifest's order is the writers', not by start
    return Manifest(step=1, config_hash="x", layout={"dp": len(entries)}, tensors=tuple(entries))


def test_index_matches_the_scan_for_any_range():
    rng = random.Random(0)
    total = 10_000
    reader = CheckpointReader(Path("/nonexistent"), manifest(sorted(rng.sample(range(1, total), 40)), total))
    index = EntryIndex(reader)
    for _ in range(300):
        start = rng.randrange(total)
        request = [("master/w", start, rng.randrange(1, total - start + 1))]
        assert set(index.entries_for(request)) == set(reader.entries_for(request)), request


def test_plan_after_a_dp_change_gives_each_old_shard_one_reader():
    total = 9_600
    reader = CheckpointReader(Path("/nonexistent"), manifest([total * k // 6 for k in range(1, 6)], total))
    needs = [[("master/w", total * r // 4, total // 4)] for r in range(4)]  # dp 6 -> 4
    plan = plan_reads(reader, needs)
    assert len(plan) == 6 and sorted(a.entry.start for a in plan) == [total * k // 6 for k in range(6)]
    for a in plan:
        assert a.reader in a.needers and all(
            needs[r][0][1] < a.entry.stop and a.entry.start < needs[r][0][1] + needs[r][0][2] for r in a.needers)
