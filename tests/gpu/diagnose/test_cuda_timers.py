"""The CUDA-event clock: marks on the stream, read later by the timings thread, and never a
device synchronisation on the loop's thread. Skips without a GPU."""

import pytest
import torch

from mshpc.diagnose.timers import PhaseTimers
from mshpc.diagnose.timings import TimingsWriter, parse_lines

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA events)")


def gpu_step(timers: PhaseTimers, step: int, a: torch.Tensor) -> None:
    timers.begin_step(step)
    with timers.phase("forward"):
        b = a @ a
        with timers.phase("comm.all_reduce"):
            b = b @ a
    with timers.phase("optimizer"):
        a.add_(b, alpha=1e-9)


def test_the_hot_path_never_synchronises_and_times_device_work(tmp_path):
    timers = PhaseTimers()
    timers.configure(True, torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    writer = TimingsWriter(tmp_path / "rank-00000.jsonl", {"rank": 0, "host": "h", "pp": 0, "dp": 0, "tp": 0}, 1.0)
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call on this thread raises
    try:
        for step in range(1, 6):
            gpu_step(timers, step, a)
            writer.put(timers.end_step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    writer.close()
    _, steps = parse_lines((tmp_path / "rank-00000.jsonl").read_text().splitlines())
    assert sorted(steps) == [1, 2, 3, 4, 5]
    # two 4096^3 GEMMs per step: device time, read after the fact by the writer's thread
    assert all(r["phases"]["forward"] > 0 and r["phases"]["comm.all_reduce"] > 0 for r in steps.values())
    for r in steps.values():
        assert sum(r["phases"].values()) == pytest.approx(r["step_s"], rel=1e-3)
