"""One reader per node, on 4 real local ranks (gloo): each rank gets exactly the ordinary loader's
batches, the clients never read the shards, a slower step never waits, a start-up failure
raises everywhere, and every exit path, kill -9 of a client or of the reader included, leaves
no rank waiting and no shared memory."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest

from mshpc.config import DataConfig
from mshpc.data.node_reader import NodeReader, ReaderScope
from mshpc.data.pipeline import build_loader
from mshpc.data.shards import TokenDataset
from mshpc.errors import DataError, MshpcError
from support.rank_runner import RankError, run_ranks
from support.token_data import holds_shared_ring, make_random_dataset, wait_until_full

SEQ, BATCH, SEED, START = 32, 8, 7, 3
WORLD = 4
NODE_CFG = DataConfig(per_node_reader=True, seed=SEED, prefetch_batches=2, doc_mask=True)


@pytest.fixture
def dataset_dir(tmp_path: Path) -> str:
    return str(make_random_dataset(tmp_path))


def node_loader(path: str, rank: int, tp: int, nodes: int, per_tp_group: bool,
                cfg: DataConfig = NODE_CFG, seq_len: int = SEQ):
    """Rank `rank`'s per-node loader; tp innermost, as in the mesh; `nodes` hosts of equal size."""
    dp_rank = rank // tp
    scope = ReaderScope(node=f"n{rank * nodes // WORLD}", key=dp_rank if per_tp_group else 0)
    dataset = TokenDataset.open(Path(path), verify=False)
    loader = build_loader(cfg, dataset, seq_len, BATCH, dp_rank, WORLD // tp, START, scope=scope)
    return loader, dataset


# (tp, nodes, per tensor-parallel group) -> {reader rank: dp ranks it serves}
GROUPINGS = [
    ((1, 1, False), {0: [0, 1, 2, 3]}),  # one node, 4 dp ranks: one reader serves all
    ((2, 1, False), {0: [0, 1]}),  # tp=2: the ranks of a tp group share a dp rank, read once
    ((1, 2, False), {0: [0, 1], 2: [2, 3]}),  # two nodes of 2 ranks: a reader on each
    ((2, 1, True), {0: [0], 2: [1]}),  # one reader per tensor-parallel group
]


def same_batches(rank: int, world: int, path: str, tp: int, nodes: int, per_tp_group: bool) -> dict:
    loader, dataset = node_loader(path, rank, tp, nodes, per_tp_group)
    is_reader = isinstance(loader.source, NodeReader)
    if not is_reader:
        dataset.close()  # a client that touched the shards would fail now
    ordinary_cfg = dataclasses.replace(NODE_CFG, per_node_reader=False, loader="torch")
    ordinary = build_loader(ordinary_cfg, TokenDataset.open(Path(path), verify=False), SEQ, BATCH,
                            rank // tp, world // tp, START)
    with loader, ordinary:
        held = holds_shared_ring()
        for _ in range(12):  # the ring of 2 slots wraps six times
            assert next(loader).equal(next(ordinary))
    return {"reader": is_reader, "served": list(loader.source.ring.layout.served),
            "held": held, "released": not holds_shared_ring()}


def slow_steps(path: str, rank: int) -> int:
    """next() calls that found no batch, when each step ends only once the loader is full."""
    cfg = dataclasses.replace(NODE_CFG, prefetch_batches=3)
    loader, _ = node_loader(path, rank, tp=1, nodes=1, per_tp_group=False, cfg=cfg)
    with loader:
        for _ in range(8):
            wait_until_full(loader, 3)  # the step is slower than the loader by construction
            assert next(loader).segments is not None  # document masks were prepared too
        return loader.stalls


def mismatched(path: str, rank: int) -> str:
    """What each rank says when rank 3 runs another config."""
    seq_len = SEQ * 2 if rank == 3 else SEQ
    try:
        node_loader(path, rank, tp=1, nodes=1, per_tp_group=False, seq_len=seq_len)
    except MshpcError as exc:
        return f"{exc} | holds ring: {holds_shared_ring()}"
    return "started"


def every_case(rank: int, world: int, path: str) -> dict:
    # One set of processes for every case: starting 4 ranks costs more than the cases do.
    groupings = [same_batches(rank, world, path, *grouping) for grouping, _ in GROUPINGS]
    return {"groupings": groupings, "stalls": slow_steps(path, rank), "mismatch": mismatched(path, rank)}


def test_batches_waits_and_start_up_failures_on_4_local_ranks(dataset_dir: str) -> None:
    results = run_ranks(every_case, WORLD, dataset_dir, timeout_s=300)
    # Every rank got exactly the ordinary loader's batches, from the readers each grouping implies.
    for i, (grouping, readers) in enumerate(GROUPINGS):
        per_rank = [res["groupings"][i] for res in results]
        assert {r: res["served"] for r, res in enumerate(per_rank) if res["reader"]} == readers, grouping
        assert all(res["held"] and res["released"] for res in per_rank), grouping
    # Counted, not timed: no next() on any rank found its batch missing behind a slower step.
    assert [res["stalls"] for res in results] == [0] * WORLD
    # A start-up failure on one rank raises on all, and none keeps the ring.
    said = [res["mismatch"] for res in results]
    assert "differ from this rank's" in said[3]
    assert all("starting the per-node reader failed on 1 other rank" in m for m in said[:3]), said
    assert all(m.endswith("holds ring: False") for m in said), said


def killed_mid_run(rank: int, world: int, path: str, victim: int) -> None:
    """The victim kills itself after two steps; each survivor checks its own end (a failed check
    would make it a second failed rank in the report)."""
    loader, _ = node_loader(path, rank, tp=1, nodes=1, per_tp_group=False)
    with loader:
        for _ in range(2):
            next(loader)
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        with pytest.raises(DataError) as lost:
            for _ in range(10_000):  # the dataset wraps; a survivor must stop well before
                next(loader)
        assert holds_shared_ring()
    assert not holds_shared_ring()  # close() unmapped the ring on this exit path too
    if rank == 0:
        assert "rank 3 (client) closed the connection" in str(lost.value)
    else:
        assert "the reader (rank 0) closed the connection" in str(lost.value)


@pytest.mark.parametrize("victim", [3, 0], ids=["client-killed", "reader-killed"])
def test_a_killed_rank_stops_the_others_and_leaves_no_shared_memory(dataset_dir: str, victim: int) -> None:
    before = {n for n in os.listdir("/dev/shm") if "mshpc" in n}
    with pytest.raises(RankError) as failed:
        run_ranks(killed_mid_run, WORLD, dataset_dir, victim, timeout_s=240, grace_s=180)
    report = str(failed.value)
    # Only the victim failed: every survivor passed its checks and returned instead of hanging.
    assert report.startswith(f"1 of {WORLD} ranks failed"), report
    assert f"rank {victim}: exited" in report and "without a result" in report
    assert {n for n in os.listdir("/dev/shm") if "mshpc" in n} == before
