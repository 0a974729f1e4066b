"""In-memory snapshots on a GPU (mshpc/snapshot/store.py): the state is copied by DMA on a side
stream into pinned slots, and the update queued after the release waits for the copies on the
device; the sealed slot holds the state as it was. Skips without a GPU."""

import pytest
import torch
import torch.distributed as dist

from mshpc.snapshot.exchange import SendExchange, build_exchange
from mshpc.snapshot.placement import Buddies
from mshpc.snapshot.slot import SlotLayout
from mshpc.snapshot.store import SnapshotStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned D2H copies)")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_snapshot_of_device_state_lands_pinned_before_the_next_update(one_rank):
    state = {"master/w": torch.randn(64 << 20, device="cuda"), "optim.step": torch.ones(1, device="cuda")}  # 256 MiB
    want = {k: v.cpu() for k, v in state.items()}
    layout = SlotLayout.of(state)
    own, exchange = build_exchange(layout, Buddies((0,), "one rank"), one_rank, pinned=True, shared=True)
    assert isinstance(exchange, SendExchange)  # shared memory is the CPU ranks' way only
    store = SnapshotStore(layout, own, exchange)
    released = []
    store.take(1, state, {"step": 1}, released.append)
    released[0]()  # on the device: the current stream waits for the copies
    for t in state.values():
        t.add_(1.0)  # queued at once, runs after the copies
    store.settle()
    slot = own[0]
    assert slot.buffer.is_pinned() and slot.problem() is None and slot.step == 1
    for name, t in slot.tensors().items():
        assert torch.equal(t, want[name]), name
