"""What the train loop sees of snapshots: a keeper that lives as long as the rank's process, one
store per generation (a generation's groups and buddies are its own), a snapshot after every
`recovery.snapshot_interval_steps` steps and one at the start, so that a fault in the very first
step has one too; and the guard that replays a suspicious step from the snapshot before it.

When a generation ends on an error, the keeper holds on to its slots: the next generation of a
recovery in place restores from them (mshpc/snapshot/restore.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mshpc.config import RecoveryConfig
from mshpc.cpu_ranks.tunings import active as cpu_tunings
from mshpc.errors import SilentDataCorruption
from mshpc.events import append_event
from mshpc.fault_hooks import NO_FAULTS, FaultHooks
from mshpc.mesh_shape import MeshShape
from mshpc.parallel import comm
from mshpc.snapshot.exchange import build_exchange
from mshpc.snapshot.placement import buddies
from mshpc.snapshot.replay import GradFingerprint, ReplayLedger, SpikeWatch, StepResult, Verdict
from mshpc.snapshot.restore import Held, Restored, restore_in_place
from mshpc.snapshot.slot import SlotLayout
from mshpc.snapshot.state import TrainState, extras, install, live_tensors
from mshpc.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)


class SnapshotKeeper:
    """One per process. Every rank calls `begin`, `after_step` and `end` alike (collectives)."""

    def __init__(self, recovery: RecoveryConfig, node: str, device: torch.device) -> None:
        self.recovery, self.node = recovery, node
        self.pinned = device.type == "cuda"  # DMA from the device needs pinned pages
        self.held = Held()
        self.store: SnapshotStore | None = None
        self.group: dist.ProcessGroup | None = None

    def begin(self, state: TrainState, shape: MeshShape, start_step: int, restore: bool,
              faults: FaultHooks = NO_FAULTS) -> tuple[int, Restored | None]:
        """A generation starts: restore in place from the last one's slots when `restore`, then
        snapshot the state training starts from. Collective over the world; returns the step
        training goes on from (SnapshotsUnusable when nothing can be restored)."""
        self.group = dist.new_group(backend="gloo")  # the snapshot thread's own: the loop talks on the others
        ring = buddies(comm.all_gather_json(self.node, self.group), shape)
        layout = SlotLayout.of(live_tensors(state.engine))
        restored = None
        if restore:
            faults.before_restore([slot.buffer for slots in self.held.wards.values() for slot in slots])
            restored = restore_in_place(self.held, layout, state, ring, self.group, self.pinned)
            start_step = restored.step
        self.held = Held()  # the last generation's slots go; this one's are made next
        # a CPU-rank tuning (mshpc/cpu_ranks): a buddy on this host maps the slots instead of receiving them
        own, exchange = build_exchange(layout, ring, self.group, self.pinned, shared=cpu_tunings().shared_buckets)
        if dist.get_rank() == 0:
            log.info("snapshots: %.1f MiB a rank, every %d step(s), kept by %s (%s)", layout.nbytes / 2**20,
                     self.recovery.snapshot_interval_steps, ring.why, type(exchange).__name__)
        self.store = SnapshotStore(layout, own, exchange)
        self.take(start_step, state)
        return start_step, restored

    def take(self, step: int, state: TrainState) -> None:
        assert self.store is not None
        self.store.take(step, live_tensors(state.engine), extras(step, state), state.engine.before_next_update)

    def after_step(self, step: int, state: TrainState) -> None:
        """After `step` updates (and their loss check): a snapshot when one is due."""
        if step % self.recovery.snapshot_interval_steps == 0:
            self.take(step, state)

    def restore(self, step: int, state: TrainState) -> None:
        """This rank's own snapshot of `step` back into the live state (a replay). Collective
        over the engine's dp group."""
        assert self.store is not None
        self.store.settle()
        slot = next(s for s in self.store.own if s.step == step and s.problem() is None)
        install(slot.tensors(), slot.extras(), state)

    def end(self) -> None:
        """The generation ends on an error: its copies settle, and its slots are kept."""
        if self.store is not None:
            self.store.close()
            self.held = Held(self.store.own, self.store.exchange.held())
            self.store = None

    def close(self) -> None:
        """The generation ends well: the snapshot in flight is sealed (its error raised)."""
        if self.store is not None:
            self.store.settle()


class StepGuard:
    """Replays a suspicious step from the snapshot taken before it (mshpc/snapshot/replay.py).
    Every rank calls `check` after each step, alike: the values it judges are global."""

    def __init__(self, recovery: RecoveryConfig, keeper: SnapshotKeeper, state: TrainState, model: nn.Module,
                 device: torch.device, run_dir: Path | None) -> None:
        self.keeper, self.state, self.run_dir = keeper, state, run_dir  # run_dir: rank 0's, for the events
        self.watch = SpikeWatch(recovery.spike_factor, recovery.spike_window_steps)
        self.ledger = ReplayLedger(recovery.persistent_after)
        self.fingerprint = GradFingerprint(model, device)

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
              again: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (loss, grad norm) to go on with: its own, or its replay's (0-based `step`)."""
        why = self.watch.suspicious(loss.item(), grad_norm.item())
        if why is None:
            self.fingerprint.reset()
            self.watch.accept(loss.item(), grad_norm.item())
            return loss, grad_norm
        first = StepResult(loss.item(), grad_norm.item(), self.fingerprint.take())
        began = time.perf_counter()
        self.keeper.restore(step, self.state)
        loss2, norm2 = again()
        second = StepResult(loss2.item(), norm2.item(), self.fingerprint.take())
        both = comm.all_gather_json([first.as_json(), second.as_json()], self.keeper.group)
        verdict = self.ledger.judge([StepResult.from_json(b[0]) for b in both],
                                    [StepResult.from_json(b[1]) for b in both])
        self._tell(step, why, verdict, time.perf_counter() - began)
        if verdict.kind == "persistent":
            self._evict(verdict, step)
        if verdict.kind == "transient":
            self.watch.accept(loss2.item(), norm2.item())
            return loss2, norm2
        self.watch.accept(loss.item(), grad_norm.item())
        return loss, grad_norm

    def _tell(self, step: int, why: str, verdict: Verdict, replay_s: float) -> None:
        if self.run_dir is None:
            return
        append_event(self.run_dir, "replay", step=step + 1, why=why, verdict=verdict.kind, ranks=list(verdict.ranks),
                     differed=verdict.differed, replay_s=round(replay_s, 3))
        log.warning("step %d replayed (%s): %s%s", step + 1, why, verdict.kind,
                    f", rank(s) {', '.join(map(str, verdict.ranks))} differed" if verdict.ranks else "")

    def _evict(self, verdict: Verdict, step: int) -> None:
        """The culprit exits with SilentDataCorruption (the supervisor evicts its node); the other
        ranks raise as peers of a failed rank do."""
        rank = dist.get_rank()
        if rank in verdict.ranks:
            raise SilentDataCorruption(f"rank {rank}'s gradients differed from its own replays "
                                       f"{self.ledger.counts[rank]} times (the last at step {step + 1}): "
                                       f"{verdict.differed[f'rank {rank}']}")
        raise RuntimeError(f"silent data corruption failed on {len(verdict.ranks)} other rank(s); see their error")
