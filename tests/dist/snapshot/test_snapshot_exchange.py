"""Snapshots on two real gloo ranks, each its own node: taken every step, kept by the buddy,
and restored in place, through shared memory and through sends alike: a replacement gets its
state from its buddy bitwise, a corrupted copy is refused for an older whole one, and a rank lost
with its buddy leaves no step to restore (every rank says why)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mshpc.config import ModelConfig, OptimConfig, ParallelConfig
from mshpc.errors import SnapshotsUnusable
from mshpc.mesh_shape import MeshShape
from mshpc.model.gpt import GPT, loss_fn
from mshpc.optim.schedule import build_scheduler
from mshpc.parallel import comm
from mshpc.parallel.zero_build import build_zero_engine
from mshpc.plan.devices import DEVICES
from mshpc.plan.layout import Layout
from mshpc.plan.snapshots import snapshot_cost
from mshpc.snapshot.exchange import SendExchange, SharedExchange, build_exchange
from mshpc.snapshot.placement import buddies
from mshpc.snapshot.restore import Held, restore_in_place
from mshpc.snapshot.slot import SlotLayout
from mshpc.snapshot.state import TrainState, extras, live_tensors
from mshpc.snapshot.store import SnapshotStore
from support.rank_runner import run_ranks

TINY = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=1)
RING = buddies(["node0", "node1"], MeshShape(pp=1, dp=2, tp=1))  # each keeps the other's


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    engine = build_zero_engine(GPT(TINY), OPTIM, ParallelConfig(dp=2, bucket_mb=16 / 1024))
    return TrainState(engine, build_scheduler(engine.optimizer, OPTIM, 10))


def _step(state: TrainState, step: int, rank: int) -> float:
    local = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len + 1), generator=torch.Generator().manual_seed(step))
    local = local[rank * 2:(rank + 1) * 2]
    loss = loss_fn(state.engine.model(local[:, :-1]), local[:, 1:])
    state.engine.backward(loss)
    state.engine.step(1.0)
    state.scheduler.step()
    comm.all_reduce(loss := loss.detach())
    return loss.item()


def _store(state: TrainState, group: dist.ProcessGroup, shared: bool) -> SnapshotStore:
    layout = SlotLayout.of(live_tensors(state.engine))
    own, exchange = build_exchange(layout, RING, group, pinned=False, shared=shared)
    return SnapshotStore(layout, own, exchange)


def _train(state: TrainState, store: SnapshotStore, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        losses.append(_step(state, step, rank))
        store.take(step + 1, live_tensors(state.engine), extras(step + 1, state), state.engine.before_next_update)
    store.settle()
    return losses


def _restore(state: TrainState, store: SnapshotStore, lost: set[int], rank: int) -> object:
    """Restore in a new group, as a new generation does; this rank replaced when in `lost`."""
    held = Held() if rank in lost else Held(store.own, store.exchange.held())
    try:
        return restore_in_place(held, store.layout, state, RING, dist.new_group(backend="gloo"), pinned=False)
    except SnapshotsUnusable as exc:
        return str(exc)


def cases(rank: int, world: int) -> dict:
    """Both ways in one run of the ranks (their start-up is most of the test's time)."""
    return {way: one_way(rank, shared) for way, shared in (("shared", True), ("send", False))}


def one_way(rank: int, shared: bool) -> dict:
    state = _state(seed=0)
    store = _store(state, dist.new_group(backend="gloo"), shared)
    slot_bytes = store.layout.nbytes
    _train(state, store, range(3), rank)  # snapshots of steps 1, 2 and 3
    undisturbed = [_step(state, step, rank) for step in (3, 4)]  # no snapshots: 3 stays the newest
    if rank == 1:  # the replacement's state is wrong everywhere: it must come from its buddy
        for t in live_tensors(state.engine).values():
            t.copy_(torch.full_like(t, 7))
    restored = _restore(state, store, {1}, rank)
    store = _store(state, dist.new_group(backend="gloo"), shared)  # the new generation's
    again = _train(state, store, range(3, 5), rank)  # snapshots of steps 4 and 5
    comm.barrier()  # shared memory: rank 1 may still be writing the slot its buddy sees
    if rank == 0:  # flip a bit of rank 1's newest copy where its buddy keeps it
        newest = max(store.exchange.held()[1], key=lambda s: s.step)
        newest.buffer[newest.layout.nbytes - 100] ^= 0x01
    corrupted = _restore(state, store, {1}, rank)
    both = _restore(state, store, {0, 1}, rank)
    return {"kind": type(store.exchange).__name__, "slot_bytes": slot_bytes,
            "step": restored.step, "fetched_from": restored.fetched_from,
            "bitwise": again == undisturbed, "corrupted_step": corrupted.step,
            "corrupted_problems": list(corrupted.problems), "both_lost": both}


@pytest.fixture(scope="module")
def results():
    return run_ranks(cases, 2, timeout_s=240)


@pytest.mark.parametrize(("way", "kind"), [("shared", SharedExchange), ("send", SendExchange)])
def test_snapshots_restore_in_place_from_the_buddy(results, way, kind):
    got = [r[way] for r in results]
    assert [r["kind"] for r in got] == [kind.__name__] * 2
    assert [r["step"] for r in got] == [3] * 2 and [r["fetched_from"] for r in got] == [None, 0]
    assert all(r["bitwise"] for r in got)  # the losses of the steps after it, as undisturbed


def test_mshpc_plan_counts_the_bytes_a_snapshot_takes(results):
    # the plan's snapshot: 12 bytes per parameter over dp; the slot adds its header, the extras'
    # room, the generators and each tensor's alignment
    layout = Layout(dp=2, tp=1, pp=1, virtual_stages=1, micro_batch=2, n_micro=1, checkpointing="none")
    planned = snapshot_cost(TINY, layout, DEVICES["h100"], step_s=1.0, interval_steps=1).snapshot_bytes
    for r in results:
        assert planned <= r["shared"]["slot_bytes"] <= planned + 128 * 1024


@pytest.mark.parametrize("way", ["shared", "send"])
def test_a_corrupted_copy_is_refused_for_the_older_whole_one(results, way):
    got = [r[way] for r in results]
    assert [r["corrupted_step"] for r in got] == [4] * 2
    assert got[0]["corrupted_problems"] == ["rank 1's step 5: failed its checksum"]


@pytest.mark.parametrize("way", ["shared", "send"])
def test_a_rank_lost_with_its_buddy_leaves_nothing_to_restore_and_every_rank_says_why(results, way):
    assert all(r[way]["both_lost"] == "no in-memory snapshot to recover in place from: rank 0 and its buddy "
               "rank 1 were both lost" for r in results)
