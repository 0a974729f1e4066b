"""The train loop's view of checkpoints: resume at start-up, save every N steps, wait at the end."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mshpc.checkpoint.catalog import Catalog, open_catalog
from mshpc.checkpoint.compat import (
    CONFIG_KEY,
    ResumeMismatchError,
    check_resume,
    check_weight_names,
    other_run_on_fresh_start,
    shape_mismatch,
)
from mshpc.checkpoint.group_read import load_for_group
from mshpc.checkpoint.model_copy import repair_on_resume
from mshpc.checkpoint.paths import remove_stale_tmp
from mshpc.checkpoint.reader import CheckpointReader, Request
from mshpc.checkpoint.relayout import SPLITS_KEY, Relayout, splits_extra
from mshpc.checkpoint.restore import candidates, resume_from
from mshpc.checkpoint.saver import CheckpointSaver, NoSpaceForSave, SaveTarget
from mshpc.checkpoint.state import (
    apply_rng,
    buffer_slices,
    checked_lrs,
    checked_scheduler_state,
    model_slices,
    persistent_buffers,
    rng_names,
    rng_slices,
    stage_rng,
)
from mshpc.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RecoveryConfig,
    TrainConfig,
    global_batch,
)
from mshpc.errors import CheckpointError, MshpcError
from mshpc.events import append_event
from mshpc.mesh_shape import Coords, MeshShape
from mshpc.model.gpt import GPT
from mshpc.parallel import comm
from mshpc.parallel.apply import tp_splits
from mshpc.parallel.expert_parallel import expert_placement
from mshpc.parallel.sharded_optim import STATE_KEYS
from mshpc.parallel.zero import ZeroEngine
from mshpc.save_schedule import SaveSchedule

log = logging.getLogger(__name__)

# how often a save that must succeed is tried again while a full disk refuses it (recovery.in_place)
SAVE_RETRY_S = 1.0


def build_dp_group(p: ParallelConfig, world: dist.ProcessGroup) -> dist.ProcessGroup:
    """Collective over the world: a gloo group of this rank and its data-parallel peers (the
    ranks with its pp and tp coordinates); the world itself when there is no tp or pp."""
    if p.tp == p.pp == 1:
        return world
    mesh = MeshShape(pp=p.pp, dp=p.dp, tp=p.tp)
    groups = [[mesh.rank(Coords(pp=pp, dp=dp, tp=tp)) for dp in range(p.dp)]
              for pp in range(p.pp) for tp in range(p.tp)]
    mine, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    return mine


class TrainCheckpointer:
    """Collective over the world: every rank calls `resume`, `save` (on the steps `schedule`
    names) and `close` alike. Checkpoints go under `root`, events to `run_dir`; `config_hash` and
    `config_record` (the resolved config as plain data, config.to_dict) are recorded with each, and
    a resume compares them with the checkpoint's (compat.py).

    With `recovery.in_place` a periodic save that fails for a full disk or quota is skipped, not
    fatal: every rank's state is also in its snapshots and its buddy's, and the next interval
    tries again. The save at the last step and a stop's save must succeed: under
    `recovery.in_place` they wait for space up to `recovery.full_disk_grace_s`, as the run's own
    files do (full_disk.py), since once the job ends its in-memory state is gone."""

    def __init__(self, root: Path, rank: int, engine: ZeroEngine, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 *, run_dir: Path, config_hash: str, config_record: dict[str, Any], checkpoint: CheckpointConfig,
                 parallel: ParallelConfig, train: TrainConfig, data: DataConfig, model_cfg: ModelConfig,
                 recovery: RecoveryConfig | None = None, before_commit: Callable[[int], None] = lambda step: None,
                 before_write: Callable[[int], None] = lambda step: None) -> None:
        self.root, self.run_dir, self.rank, self.world_size = root, run_dir, rank, parallel.world_size
        self.engine, self.optimizer, self.scheduler = engine, engine.optimizer, scheduler
        self.parallel, self.resume_from, self.async_save = parallel, train.resume, checkpoint.async_save
        self.config_hash, self.config_record, self.model_cfg = config_hash, config_record, model_cfg
        self.shared_dir = checkpoint.dir is not None  # set, so perhaps shared with other runs
        # where the data stream stands after a step: a resume with other settings reads other windows
        self.data_position = {"seed": data.seed, "global_batch": global_batch(train, parallel),
                              "seq_len": model_cfg.seq_len}
        # A CPU group of its own: the saver's thread talks on it while the loop uses the default one.
        self.group = dist.new_group(backend="gloo")
        self.dp_group = build_dp_group(parallel, self.group)  # restore shares reads within it
        p = parallel
        target = SaveTarget(root=root, keep=checkpoint.keep, config_hash=config_hash,
                            layout={"dp": p.dp, "tp": p.tp, "pp": p.pp})
        self.saver = CheckpointSaver(target, rank, self.group, checkpoint.async_save, before_commit, before_write)
        self.schedule = SaveSchedule.of(checkpoint=checkpoint, train=train)
        # the state lives on in memory snapshots on a buddy too: a save that finds no room can wait
        self.skip_full_disk = recovery is not None and recovery.in_place
        self.full_disk_grace_s = recovery.full_disk_hold_s if recovery is not None else 0.0
        self.saved_step: int | None = None  # the last save started and not found failed
        self._restored: dict[str, int] = {}  # what the last restore's stage read and received
        self._changes: list[str] = []  # the settings changed since the checkpoint being resumed
        self._stage1_wait_s: float | None = None  # how long the last update waited for a save's stage 1
        self._splits = tp_splits(engine.model)  # how tp cut this stage (empty at tp=1), for resharding
        # every stage's rules go into the manifest, which rank 0 writes from a stage of its own
        self._all_splits = {n: rule for rank in comm.all_gather_json(splits_extra(self._splits), group=self.group)
                            for n, rule in rank.items()}

    # ---------------------------------------------------------------- save

    def _extras(self, step: int) -> dict[str, Any]:
        extras = {
            "step": step, "world_size": self.world_size,
            "scheduler": self.scheduler.state_dict(),
            "group_lrs": [g["lr"] for g in self.optimizer.param_groups],
            "data": self.data_position,
            CONFIG_KEY: self.config_record,  # what a resume compares itself with (compat.py)
        }
        if self._all_splits:
            extras[SPLITS_KEY] = dict(sorted(self._all_splits.items()))  # another tp joins and re-cuts by them
        return extras

    def save(self, step: int, must_succeed: bool = False) -> float:
        """Save now, after `step` optimizer steps; return the seconds the loop was blocked. The
        outcome of the save before is settled first (the same on every rank: rank 0 broadcast
        it). A save that need not succeed (not the last step's, not `must_succeed`) may fail for
        a full disk under `skip_full_disk`: a `checkpoint_failed` event, and training goes on."""
        start = time.perf_counter()
        self._settle(self.saver.wait, must_succeed=False)  # an async save found failed here was periodic
        waited = time.perf_counter() - start
        self.saved_step = step
        blocking = self._settle(lambda: self._start_save(step), must_succeed or step == self.schedule.last_step)
        return waited + blocking if blocking is not None else time.perf_counter() - start

    def _settle(self, action: Callable[[], float | None], must_succeed: bool) -> float | None:
        """Run `action` (which waits for a save); a save failed for a full disk is noted and
        skipped when allowed, else raised as the one-line CheckpointError it always was."""
        try:
            return action()
        except NoSpaceForSave as exc:
            if not self.skip_full_disk:
                raise CheckpointError(str(exc)) from None
            if must_succeed:
                return self._save_again(exc)
            self._note_failed(exc)
            return None

    def _save_again(self, exc: NoSpaceForSave) -> float:
        """A save that must succeed, refused by a full disk under recovery.in_place: tried again
        every SAVE_RETRY_S up to recovery.full_disk_grace_s. The same number of tries on every
        rank, each failing or succeeding on all alike (rank 0 broadcasts the outcome), so the ranks
        stay in step; the one-line error after the last. Only the save last started is saved
        again: nothing has updated the state since (it is the last step's, or a stop's)."""
        tries = math.ceil(self.full_disk_grace_s / SAVE_RETRY_S)
        if tries == 0 or exc.step != self.saved_step:
            raise CheckpointError(str(exc)) from None
        if self.rank == 0:
            log.warning("%s; the save must succeed: trying again every %g s for up to %g s "
                        "(recovery.full_disk_grace_s)", exc, SAVE_RETRY_S, self.full_disk_grace_s)
        start = time.perf_counter()
        for _ in range(tries):
            time.sleep(SAVE_RETRY_S)
            try:
                self._start_save(exc.step)
                self.saver.wait()  # settled here: the caller's next wait finds nothing in flight
                if self.rank == 0:
                    log.info("checkpoint of step %d saved after %.1f s of full disk", exc.step,
                             time.perf_counter() - start)
                return time.perf_counter() - start
            except NoSpaceForSave as again:
                exc = again
        raise CheckpointError(f"{exc} (still full after {self.full_disk_grace_s:g} s of "
                              "recovery.full_disk_grace_s)") from None

    def _note_failed(self, exc: NoSpaceForSave) -> None:
        """Every rank alike (the outcome came from rank 0): the save is forgotten; rank 0 writes
        the event, if the run directory takes it, and one warning line."""
        if self.saved_step == exc.step:
            self.saved_step = None
        if self.rank != 0:
            return
        free = "unknown" if exc.free_bytes is None else f"{exc.free_bytes / 2**20:.1f} MiB"
        log.warning("%s; training goes on from the in-memory snapshots (recovery.in_place), the checkpoint before "
                    "stays the latest, the next interval saves again (%s free)", exc, free)
        try:
            append_event(self.run_dir, "checkpoint_failed", step=exc.step, reason=str(exc),
                         free_bytes=exc.free_bytes)
        except (MshpcError, OSError) as event_exc:  # the same full disk may hold the run directory
            log.warning("the checkpoint_failed event of step %d was not recorded: %s", exc.step, event_exc)

    def _start_save(self, step: int) -> float:
        self.engine.wait_params()  # the weights of this step, not half-gathered ones
        slices = {**rng_slices(self.rank), **self.engine.state_slices()}
        # The dp-replicated weights (each tp rank its own shards), for inference and inspection,
        # spread over the dp ranks; resume rebuilds the weights from the fp32 masters and only
        # checks this copy (model_copy.py). At ZeRO stage 3 no rank holds a weight whole between
        # uses: each saves its pieces, cast from its masters (the same tensors, other slices).
        p = self.parallel
        if self.engine.units is None:
            slices.update(model_slices(self.engine.model, self.engine.mp, self.engine.rank, p.dp,
                                       expert_placement(self.engine.model), p.ep))
        else:
            slices.update(self.engine.weight_slices())
        slices.update(buffer_slices(self.engine.model, self.engine.rank == 0 and self.engine.mp.tp_rank == 0))
        blocking = self.saver.save(step, slices, self._extras(step))
        if self.async_save:  # stage 1 overlaps the next forward and backward
            self.engine.before_next_update(self._release)
        return blocking

    def _release(self) -> None:
        self._stage1_wait_s = self.saver.release()

    def pop_stage1_wait(self) -> float | None:
        """Seconds the last update waited for the previous save's stage 1 to finish copying (the
        part of a save's cost that its blocking time does not show); None if it waited for none.
        Reading it clears it."""
        wait, self._stage1_wait_s = self._stage1_wait_s, None
        return wait

    def close(self) -> None:
        """Wait for the save in flight; raises if it failed: the last step's and a stop's save
        must succeed."""
        self._settle(self.saver.wait, must_succeed=True)

    @property
    def in_flight_step(self) -> int | None:
        return self.saver.in_flight_step

    def close_after_error(self) -> None:
        """On the way out after an error: let the save in flight end before the process group
        its thread talks on is destroyed. Every live rank's save thread goes on, so the save
        commits (a checkpoint the restart can use) unless a rank is gone, and then its
        collective fails at once. Its failure is logged; the error being raised is the rank's.
        Every rank that waits says so: the rank whose own error ends the run is the one that
        waits (its peers learn of it only when it exits, and the supervisor may stop them then)."""
        step = self.saver.in_flight_step
        if step is None:
            return
        log.warning("rank %d: finishing the checkpoint of step %d in flight before exiting", self.rank, step)
        try:
            self.saver.wait()
        except Exception as exc:
            log.warning("rank %d: the checkpoint of step %d in flight failed too: %s", self.rank, step, exc)

    # ---------------------------------------------------------------- resume

    def resume(self) -> int:
        """Install the checkpoint `train.resume` names; return the step to continue from."""
        mode = self.resume_from
        if mode == "never":
            self._check_fresh_start()
            return 0
        if mode == "auto":
            if self.rank == 0:
                remove_stale_tmp(self.root)
            folders = candidates(self.root)
        else:
            folders = [Path(mode)]
            if not folders[0].is_dir():
                raise CheckpointError(f"train.resume={mode!r}: no such checkpoint folder (or use 'auto'/'never')")
        start = time.perf_counter()
        picked = resume_from(folders, self._stage, self.group)
        if picked is None:
            return 0
        seconds = time.perf_counter() - start
        folder, catalog = picked
        start = time.perf_counter()
        self._repair_model_copy(folder, catalog)
        self._restored["manifest_bytes_parsed"] = catalog.bytes_parsed  # the index and this rank's entries
        self._report_restore(catalog.head.step, seconds, time.perf_counter() - start)
        return catalog.head.step

    def _check_fresh_start(self) -> None:
        """train.resume never in a set checkpoint.dir: refuse when its newest checkpoint is another
        run's, whose checkpoints this run's saves would prune. Every rank reads the same head."""
        folders = candidates(self.root) if self.shared_dir else []
        if not folders:
            return
        try:
            extras = open_catalog(folders[0]).head.extras
        except CheckpointError:
            return  # unreadable: not evidence of another run
        error = other_run_on_fresh_start(folders[0], extras, config_record=self.config_record)
        if error is not None:
            raise error

    def _repair_model_copy(self, folder: Path, catalog: Catalog) -> None:
        """Collective over all ranks: the checkpoint just taken is trusted only with its model/
        copy checked; rank 0 writes an event for each bad tensor, rebuilt from the masters."""
        step = catalog.head.step
        repairs, manifest_error = repair_on_resume(folder, catalog, self.group)
        if self.rank != 0:
            return
        for r in repairs:
            fields = {"step": step, "tensor": r.tensor, "file": str(folder / r.file),
                      "problem": r.problem}
            if r.error is None:
                append_event(self.run_dir, "checkpoint_repaired", **fields)
                log.warning("checkpoint %s: rebuilt the model copy %s in %s from the masters (%s)",
                            folder, r.tensor, r.file, r.problem)
            else:
                append_event(self.run_dir, "checkpoint_repair_failed", **fields, error=r.error)
                log.warning("checkpoint %s: the model copy %s in %s is bad (%s) and could not be rebuilt: "
                            "%s; training goes on from the masters", folder, r.tensor, r.file, r.problem, r.error)
        if manifest_error is not None:
            append_event(self.run_dir, "checkpoint_repair_failed", step=step, error=manifest_error)
            log.warning("checkpoint %s: %s", folder, manifest_error)

    def _requests(self, reader: CheckpointReader, relayout: Relayout, same_world: bool) -> list[Request]:
        """What this rank needs: its own 1/dp range of the masters and optimizer state (at
        another tp: every saved part of those weights, `relayout`), the step counter and (at the
        same world size) its RNG states."""
        out: list[Request] = []
        for piece in self.engine.pieces:
            shape = relayout.shape(reader, f"master/{piece.key}")
            if shape != piece.shape:
                raise shape_mismatch(reader.folder, f"master/{piece.key}", shape, piece.shape)
            for prefix in ("master", *(f"optim.{k}" for k in STATE_KEYS)):
                out += relayout.requests(reader, (f"{prefix}/{piece.key}", piece.start, piece.tensor.numel()))
        out.append(("optim.step", 0, 1))
        out += [reader.whole(f"buffer/{n}") for n in persistent_buffers(self.engine.model)]
        out += [reader.whole(n) for n in rng_names(reader, self.rank, same_world)]
        reader.entries_for(out)  # an unknown name fails here, before any collective
        return out

    def _stage(self, reader: CheckpointReader) -> Callable[[], None]:
        """Collective over all ranks: read and verify what this rank needs into the reader's
        cache, each byte read by one rank of its dp group (group_read.py), so installing it
        cannot fail half-way."""
        extras = reader.catalog.head.extras
        self._check_compatible(reader)
        same_world = extras.get("world_size") == self.world_size
        requests, error, mismatch, relayout = [], None, None, Relayout(1, 1, 0)
        scheduler: dict[str, Any] = {}
        lrs: list[float] = []
        try:
            # extras from the manifest are checked before anything is read, let alone applied
            scheduler = checked_scheduler_state(extras.get("scheduler"), self.scheduler.state_dict(), str(reader.folder))
            lrs = checked_lrs(extras.get("group_lrs"), len(self.optimizer.param_groups), str(reader.folder))
            relayout = Relayout.build(reader, self.parallel.tp, self.engine.mp.tp_rank, self._splits,
                                      self.engine.mp.tied)
            requests = self._requests(reader, relayout, same_world)
        except ResumeMismatchError as exc:
            mismatch = str(exc)
        except CheckpointError as exc:
            error = str(exc)
        # a stage's weight of another shape is seen by that stage's ranks only: all learn of it
        mismatches = [m for m in comm.all_gather_json(mismatch, group=self.group) if m]
        if mismatches:
            raise ResumeMismatchError(mismatches[0])
        load_for_group(reader, requests, self.dp_group, error)
        rng = stage_rng(reader, rng_names(reader, self.rank, same_world))
        buffers = {n: reader.read_whole(f"buffer/{n}") for n in persistent_buffers(self.engine.model)}
        for name, b in persistent_buffers(self.engine.model).items():  # a crafted shape: one line, not copy_'s error
            if buffers[name].shape != b.shape:
                raise CheckpointError(f"{reader.folder}: buffer/{name} has shape {list(buffers[name].shape)}, the "
                                      f"model {list(b.shape)}")
        self._restored = {"bytes_read": reader.stats.bytes_read, "entries_read": len(reader.stats.entries),
                          "bytes_received": reader.bytes_received}

        def install() -> None:
            self.engine.load_state_slices(relayout.reader(reader))  # collective over dp: re-gathers weights
            apply_rng(rng)
            with torch.no_grad():
                for name, b in persistent_buffers(self.engine.model).items():
                    b.copy_(buffers[name])
            self.scheduler.load_state_dict(scheduler)
            for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            if self._changes and self.rank == 0:
                log.info("resuming %s with changed settings: %s", reader.folder.name, "; ".join(self._changes))
            if extras.get("data") != self.data_position:
                log.warning("data settings changed since the checkpoint (%s -> %s): the data order "
                            "from here on differs from the original run's", extras.get("data"),
                            self.data_position)

        return install

    def _check_compatible(self, reader: CheckpointReader) -> None:
        """Refuse, on every rank alike (all read the same head), a checkpoint of another model
        or of another run sharing checkpoint.dir; note the settings that changed since it."""
        head = reader.catalog.head
        self._changes = check_resume(reader.folder, head.config_hash, head.extras, config_hash=self.config_hash,
                                     config_record=self.config_record, model_cfg=self.model_cfg)
        if CONFIG_KEY not in head.extras:
            with torch.device("meta"):
                names = {n for n, _ in GPT(self.model_cfg).named_parameters(remove_duplicate=False)}
            check_weight_names(reader.folder, reader.catalog.names(), self.model_cfg, names)

    def _report_restore(self, step: int, seconds: float, model_check_s: float) -> None:
        """Collective over all ranks: rank 0 logs the restore and appends one event with what
        each rank read from the file system and received from its dp peers, and the seconds the
        model copy's check took after it."""
        ranks = comm.all_gather_json(self._restored, group=self.group)
        if self.rank != 0:
            return
        fields = {key: [r[key] for r in ranks] for key in ranks[0]}
        append_event(self.run_dir, "checkpoint_restore", step=step, seconds=round(seconds, 3),
                     model_check_s=round(model_check_s, 3), **fields)
        log.info("resumed from step %d in %.1f s: %.1f MiB read by %d ranks, %.1f MiB broadcast",
                 step, seconds, sum(fields["bytes_read"]) / 2**20, sum(1 for b in fields["bytes_read"] if b),
                 sum(fields["bytes_received"]) / 2**20)
