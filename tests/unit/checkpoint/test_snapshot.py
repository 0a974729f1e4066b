"""Stage 1 on CPU: every kind of slice lands in the host buffer bit for bit, through memmove
(contiguous) or copy_ (a strided view), and the buffer is reused and detached from the state;
started in the background, the copies are complete when `release` returns."""

import pytest
import torch

from mshpc.checkpoint.h5_shard import ALIGN_BYTES
from mshpc.checkpoint.saver import HostSnapshot, Stage1
from mshpc.tensor_slice import TensorSlice
from mshpc.errors import CheckpointError


def _state() -> dict[str, torch.Tensor]:
    big = ALIGN_BYTES // 4 * 3 + 5  # larger than one aligned block, and not a multiple of it
    return {
        "large": torch.randn(big),
        "small_bf16": torch.randn(7, dtype=torch.bfloat16),
        "offset_view": torch.randn(2, big)[1],  # contiguous, but not at its storage's start
        "transposed": torch.randn(33, 65).t(),  # strided: the copy_ path
        "empty": torch.empty(0, 4),
    }


def test_snapshot_is_a_bitwise_copy_in_reused_buffers():
    state = _state()
    snapshot = HostSnapshot()
    first = snapshot.take({k: TensorSlice.whole(v) for k, v in state.items()})
    for name, piece in first.items():
        assert piece.tensor.shape == state[name].shape, name
        assert piece.tensor.is_contiguous(), name
        assert torch.equal(piece.tensor, state[name]), name  # randn: no NaN, no -0.0
    pointers = {k: p.tensor.data_ptr() for k, p in first.items()}
    taken = {k: p.tensor.clone() for k, p in first.items()}
    for t in state.values():
        t.add_(1)  # the next step changes the state: the snapshot must not change with it
    for name, piece in first.items():
        assert torch.equal(piece.tensor, taken[name]), name
    second = snapshot.take({k: TensorSlice.whole(v) for k, v in state.items()})
    for name, piece in second.items():
        assert piece.tensor.data_ptr() == pointers[name], name  # the same buffer, no allocation
        assert torch.equal(piece.tensor, state[name]), name


def test_started_copies_land_before_release_returns():
    """Stage 1 overlapping the next step: `start` returns at once, and once `release` returns
    the caller may write the state without touching the copies."""
    state = {**_state(), "big": torch.randn(16 << 20)}  # 64 MiB: the copy outlasts the call
    snapshot = HostSnapshot()
    stage1 = snapshot.start({k: TensorSlice.whole(v) for k, v in state.items()})
    want = {k: v.clone() for k, v in state.items()}
    stage1.release()
    for t in state.values():
        t.add_(1)  # the optimizer's update
    host = stage1.wait()
    assert list(host) == list(state)
    for name, piece in host.items():
        assert torch.equal(piece.tensor, want[name]), name


def test_a_failed_copy_is_reported_by_release_and_wait():
    sparse = torch.eye(3).to_sparse()  # no layout a host buffer holds: the copy raises
    stage1 = Stage1(HostSnapshot(), {"w": TensorSlice.whole(sparse)})
    with pytest.raises(CheckpointError, match="stage 1"):
        stage1.release()
    with pytest.raises(CheckpointError, match="stage 1"):
        stage1.wait()
