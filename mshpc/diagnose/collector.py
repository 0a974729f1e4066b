"""The train loop's side of diagnosis: time each step, hand it to the timings thread, and on
rank 0 watch achieved TFLOP/s (MFU declines) and every rank's timings (stragglers)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mshpc.config import DiagnoseConfig, ModelConfig, ParallelConfig
from mshpc.diagnose.mfu import MfuDeclineDetector, achieved_tflops
from mshpc.diagnose.stragglers import StragglerWatch
from mshpc.diagnose.timers import TIMERS
from mshpc.diagnose.timings import RankInfo, TimingsWriter, header, rank_file
from mshpc.diagnose.watch_stream import StreamWriter
from mshpc.events import append_event
from mshpc.mesh_shape import MeshShape

log = logging.getLogger(__name__)

# How long rank 0's last straggler look waits for the other ranks' final records at a normal end:
# they close within moments of rank 0 (every step ends in a collective), unless one is stuck in
# its own close (a slow disk), which must not hold the run's exit for long.
FINAL_WAIT_S = 10.0


class Collector:
    """Built by `build_collector`; every rank calls begin_step / end_step around each step and
    close() at the end. Never communicates."""

    def __init__(self, run_dir: Path, writer: TimingsWriter | None, mfu_watch: MfuDeclineDetector | None,
                 straggler_watch: StragglerWatch | None, peak_tflops: float | None, *, model_cfg: ModelConfig,
                 world_size: int, mfu_warn_decline: float) -> None:
        self.run_dir, self.model_cfg, self.world_size = run_dir, model_cfg, world_size
        self.mfu_warn_decline = mfu_warn_decline
        self.writer, self.mfu_watch, self.straggler_watch = writer, mfu_watch, straggler_watch
        self.peak_tflops = peak_tflops
        self._mfu_warned = False  # the decline in progress has been warned of

    def begin_step(self, step: int) -> None:
        TIMERS.begin_step(step)

    def end_step(self, step: int, tokens_per_s: float) -> float:
        """Close the step's timers; returns the model TFLOP/s each device achieved."""
        spans = TIMERS.end_step()
        if spans is not None and self.writer is not None:
            self.writer.put(spans)
        tflops = achieved_tflops(tokens_per_s, self.model_cfg, self.world_size)
        if self.mfu_watch is not None:
            self._watch_mfu(step, tflops, self.mfu_watch)
        return tflops

    def _watch_mfu(self, step: int, tflops: float, watch: MfuDeclineDetector) -> None:
        """Rank 0: an event per decline; a warning once a decline goes past the floor
        (diagnose.mfu_warn_decline): less is what a shared host's other work costs a local run."""
        decline = watch.update(step, tflops)
        if decline is not None:
            peak = self.peak_tflops
            append_event(self.run_dir, "mfu_decline", **decline.__dict__,
                         mfu=decline.median_tflops / peak if peak else None,
                         best_mfu=decline.best_tflops / peak if peak else None)
        if not watch.declined:
            self._mfu_warned = False
        elif not self._mfu_warned and watch.drop >= self.mfu_warn_decline:
            self._mfu_warned = True
            log.warning("MFU decline at step %d: %.3g TFLOP/s, %.0f%% below the run's best (%.3g)", step,
                        (1 - watch.drop) * watch.best, 100 * watch.drop, watch.best)

    def close(self, final_step: int | None = None) -> None:
        """Write what is queued; rank 0 then looks once more for stragglers. `final_step`: the
        run ended normally there, so every rank is closing too and rank 0 waits (boundedly) for
        their last records; after a failure it looks at what is there and does not wait."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.straggler_watch is not None:
            if final_step is None:
                self.straggler_watch.poll()
            else:
                self.straggler_watch.poll_until(final_step, FINAL_WAIT_S)
            self.straggler_watch.close()
            self.straggler_watch = None


def build_collector(run_dir: Path, rank: int, host: str, device: torch.device, start_step: int,
                    peak_tflops: float | None, *, diagnose: DiagnoseConfig, model_cfg: ModelConfig,
                    parallel: ParallelConfig) -> Collector:
    """Configure this process's timers and start its timings thread (rank 0: and the watches)."""
    d, p = diagnose, parallel
    TIMERS.configure(d.timers, device)
    mesh = MeshShape(pp=p.pp, dp=p.dp, tp=p.tp)
    coords = mesh.coords(rank)
    straggler_watch = None
    if rank == 0 and d.timers and d.straggler_check_interval_steps:
        straggler_watch = StragglerWatch(run_dir, p.world_size, d, start_step)
    writer = None
    if d.timers:
        head = header(RankInfo(rank, host, coords), TIMERS.clock_name, start_step, mesh)
        # the watch stream is written only for a watch to read it
        stream = (StreamWriter(run_dir, rank, head, start_step, d.watch_ranks_per_file)
                  if d.straggler_check_interval_steps else None)
        writer = TimingsWriter(rank_file(run_dir, rank), head, d.flush_interval_s,
                               straggler_watch.after_write if straggler_watch else lambda step: None, stream)
    mfu_watch = MfuDeclineDetector(d.mfu_window_steps, d.mfu_decline) if rank == 0 else None
    return Collector(run_dir, writer, mfu_watch, straggler_watch, peak_tflops, model_cfg=model_cfg,
                     world_size=p.world_size, mfu_warn_decline=d.mfu_warn_decline)
