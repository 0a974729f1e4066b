"""Stage 1 on a GPU: the state lands in pinned host buffers (a DMA), reused from one save to the
next; started on a side stream, the copies come before any update queued after `release`; a
saved CUDA state restores bit for bit. Skips without a GPU."""

import pytest
import torch
import torch.distributed as dist

from mshpc.checkpoint.manifest import read_manifest
from mshpc.checkpoint.paths import step_dir
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.saver import CheckpointSaver, HostSnapshot, SaveTarget
from mshpc.tensor_slice import TensorSlice

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned D2H copies)")


def test_snapshot_copies_into_reused_pinned_buffers():
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, dtype=torch.bfloat16, device="cuda")}
    snapshot = HostSnapshot()
    first = snapshot.take({k: TensorSlice.whole(v) for k, v in state.items()})
    for name, piece in first.items():
        assert piece.tensor.device.type == "cpu" and piece.tensor.is_pinned(), name
        assert torch.equal(piece.tensor, state[name].cpu()), name
    state["w"].add_(1.0)  # the next step changes the weights: the next save sees the change
    second = snapshot.take({k: TensorSlice.whole(v) for k, v in state.items()})
    assert second["w"].tensor.data_ptr() == first["w"].tensor.data_ptr()  # the same buffer
    assert torch.equal(second["w"].tensor, state["w"].cpu())


def test_side_stream_copies_precede_the_update_queued_after_release():
    state = {"w": torch.randn(64 << 20, device="cuda"), "b": torch.randn(7, device="cuda")}  # 256 MiB
    want = {k: v.cpu() for k, v in state.items()}
    stage1 = HostSnapshot().start({k: TensorSlice.whole(v) for k, v in state.items()})
    stage1.release()  # on the device: the current stream waits for the copies
    for t in state.values():
        t.add_(1.0)  # queued at once, runs after the copies
    host = stage1.wait()
    for name, piece in host.items():
        assert piece.tensor.is_pinned() and torch.equal(piece.tensor, want[name]), name


def test_cuda_state_saves_and_restores_bitwise(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = {"master/w": torch.randn(3, 1000, device="cuda"), "optim.exp_avg/w": torch.randn(3000, device="cuda")}
        target = SaveTarget(root=tmp_path, keep=1, layout={"dp": 1, "tp": 1, "pp": 1}, config_hash="gpu")
        saver = CheckpointSaver(target, rank=0, group=dist.new_group(backend="gloo"), async_save=True)
        saver.save(1, {k: TensorSlice.whole(v) for k, v in state.items()}, extras={})
        saver.wait()
    finally:
        dist.destroy_process_group()
    folder = step_dir(tmp_path, 1)
    reader = CheckpointReader(folder, read_manifest(folder))
    for name, want in state.items():
        assert torch.equal(reader.read_whole(name).to("cuda"), want), name
