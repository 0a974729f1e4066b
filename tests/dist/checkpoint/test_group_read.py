"""MegaScale's restore rule on real gloo ranks: within a dp group every byte of a checkpoint is
read from the file system by one rank only, and ranks that need it too get it by broadcast."""

from pathlib import Path

import h5py
import pytest
import torch
import torch.distributed as dist

from support.ckpt_runs import sharded_checkpoint
from mshpc.checkpoint.group_read import load_for_group, plan_reads
from mshpc.checkpoint.manifest import INDEX_FILE, MANIFEST_FILE, read_manifest
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.restore import resume_from
from mshpc.checkpoint.shard_read import entry_nbytes
from mshpc.errors import CheckpointError
from support.rank_runner import run_ranks

SAVED_DP = 2
SHAPES = {"master/w": (64, 100), "optim.exp_avg/w": (64, 100), "master/b": (300,)}


def full(name: str) -> torch.Tensor:
    n = 1
    for d in SHAPES[name]:
        n *= d
    return (torch.arange(n, dtype=torch.float32) + 1000 * len(name)).reshape(SHAPES[name])


def write(folder: Path, extra: dict[str, torch.Tensor] | None = None) -> None:
    """A dp=2 checkpoint: ZeRO-like halves of each tensor (and of each of `extra`), the step
    counter in shard 0 only, and each rank's RNG state in its own shard."""
    whole = {"optim.step": (torch.tensor(5.0), 0),
             **{f"rng/cpu/rank-{r}": (torch.full((40,), r, dtype=torch.uint8), r) for r in range(SAVED_DP)}}
    sharded_checkpoint(folder, {**{n: full(n) for n in SHAPES}, **(extra or {})}, n_shards=SAVED_DP, whole=whole)


def requests(rank: int, world: int) -> list[tuple[str, int, int]]:
    """What a rank at dp=`world` needs: its 1/world range of each tensor, the step counter, and
    its own RNG state when the world size is the one that saved."""
    out = []
    for name, shape in SHAPES.items():
        n = torch.Size(shape).numel()
        lo, hi = n * rank // world, n * (rank + 1) // world
        out.append((name, lo, hi - lo))
    out.append(("optim.step", 0, 1))
    if world == SAVED_DP:
        out.append((f"rng/cpu/rank-{rank}", 0, 40))
    return out


def restore_rank(rank: int, world: int, folder: str) -> dict:
    reader = CheckpointReader(Path(folder), read_manifest(Path(folder)))
    mine = requests(rank, world)
    try:
        load_for_group(reader, mine, dist.new_group(backend="gloo"))
    except CheckpointError as exc:
        return {"error": str(exc)}
    loaded = list(reader.stats.entries)
    values_ok = all(torch.equal(reader.read(n, s, c), full(n).reshape(-1)[s:s + c]) for n, s, c in mine if n in SHAPES)
    return {"values_ok": values_ok, "step": reader.read("optim.step", 0, 1).item(),
            "rng": reader.read(f"rng/cpu/rank-{rank}", 0, 40).tolist() if world == SAVED_DP else None,
            "entries": loaded, "entries_after_reads": reader.stats.entries,  # an on-demand read would show
            "bytes_read": reader.stats.bytes_read, "bytes_received": reader.bytes_received}


def needed_entries(folder: Path, world: int) -> dict[str, int]:
    """file:dataset -> bytes of every entry some rank at dp=`world` needs."""
    reader = CheckpointReader(folder, read_manifest(folder))
    needed = {e for r in range(world) for e in reader.entries_for(requests(r, world))}
    return {f"{e.file}:{e.dataset}": entry_nbytes(e) for e in needed}


@pytest.mark.parametrize("world", [2, 4])
def test_each_byte_is_read_by_one_rank_and_broadcast_to_the_others(tmp_path, world):
    write(tmp_path)
    out = run_ranks(restore_rank, world, str(tmp_path), timeout_s=120)
    assert all(o["values_ok"] and o["step"] == 5.0 for o in out)
    if world == SAVED_DP:
        assert [o["rng"] for o in out] == [[r] * 40 for r in range(world)]
    read = [e for o in out for e in o["entries"]]
    assert len(read) == len(set(read)), "an entry was read by two ranks"
    needed = needed_entries(tmp_path, world)
    assert set(read) == set(needed)
    assert [o["bytes_read"] for o in out] == [sum(needed[e] for e in o["entries"]) for o in out]
    assert all(o["bytes_read"] > 0 for o in out)  # the reads are spread over the group
    assert all(o["entries_after_reads"] == o["entries"] for o in out)  # nothing read on demand
    if world == SAVED_DP:
        # each rank's own shard is its own: only the 4-byte step counter travels
        assert sorted(o["bytes_received"] for o in out) == [0, 4]
        assert [{e.split(":")[0] for e in o["entries"]} for o in out] == [{"shard-00000.h5"}, {"shard-00001.h5"}]
    else:
        # each saved half is needed by two of the four ranks: read by one, broadcast to the other
        assert all(o["bytes_received"] > 0 for o in out)


def test_a_corrupt_entry_fails_every_rank_alike(tmp_path):
    write(tmp_path)
    with h5py.File(tmp_path / "shard-00001.h5", "r") as f:
        offset = f["master/w"].id.get_offset()
    with open(tmp_path / "shard-00001.h5", "r+b") as f:
        f.seek(offset + 8)
        f.write(b"\xff")
    out = run_ranks(restore_rank, 4, str(tmp_path), timeout_s=120)
    want = "shard-00001.h5:master/w: checksum mismatch for tensor 'master/w'"
    assert all(want in o["error"] for o in out)


def test_plan_spreads_reads_over_the_ranks_that_need_them(tmp_path):
    write(tmp_path)
    reader = CheckpointReader(tmp_path, read_manifest(tmp_path))
    plan = plan_reads(reader, [requests(r, 4) for r in range(4)])
    assert all(a.reader in a.needers for a in plan)
    load = [sum(entry_nbytes(a.entry) for a in plan if a.reader == r) for r in range(4)]
    biggest = max(entry_nbytes(a.entry) for a in plan)
    assert max(load) - min(load) <= biggest  # greedy, largest first: within one entry of even
    step = next(a for a in plan if a.entry.name == "optim.step")
    assert step.needers == (0, 1, 2, 3)


def resume_rank(rank: int, world: int, folder: str) -> dict:
    """The real resume path (restore.py) with load_for_group as its stage."""
    group = dist.new_group(backend="gloo")
    got: dict = {}

    def stage(reader: CheckpointReader):
        load_for_group(reader, requests(rank, world), group)
        got["values_ok"] = all(torch.equal(reader.read(n, s, c), full(n).reshape(-1)[s:s + c])
                               for n, s, c in requests(rank, world) if n in SHAPES)
        return lambda: None

    picked = resume_from([Path(folder)], stage, group)
    assert picked is not None
    return {**got, "indexed": picked[1].indexed, "bytes_parsed": picked[1].bytes_parsed}


@pytest.mark.parametrize("kind", ["indexed", "without an index"])
def test_resume_parses_only_what_the_group_needs_and_old_checkpoints_still_restore(tmp_path, kind):
    write(tmp_path, {"optim.exp_avg_sq/unused": torch.zeros(50)})
    if kind == "indexed":  # a tensor no rank asks for, with manifest lines no parser accepts
        path = tmp_path / MANIFEST_FILE
        path.write_text(path.read_text().replace('"name":"optim.exp_avg_sq/unused","global_shape":[50]',
                                                 '"name":"optim.exp_avg_sq/unused","global_shape":[5]]'))
        with pytest.raises(CheckpointError, match="unreadable"):
            read_manifest(tmp_path)  # read whole, the manifest is unusable
    else:
        (tmp_path / INDEX_FILE).unlink()  # as an older mshpc wrote it
    out = run_ranks(resume_rank, SAVED_DP, str(tmp_path), timeout_s=120)
    assert all(o["values_ok"] for o in out)
    size = (tmp_path / MANIFEST_FILE).stat().st_size
    if kind == "indexed":
        assert all(o["indexed"] and o["bytes_parsed"] < size for o in out)
    else:
        assert all(not o["indexed"] and o["bytes_parsed"] == size for o in out)
