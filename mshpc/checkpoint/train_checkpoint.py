"""The train loop's view of checkpoints: resume at start-up, save every N steps, wait at the end."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mshpc.checkpoint.paths import remove_stale_tmp
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.restore import candidates, resume_from
from mshpc.checkpoint.saver import CheckpointSaver, SaveTarget
from mshpc.checkpoint.state import apply_rng, model_slices, rng_slices, stage_rng
from mshpc.config import Config, config_hash
from mshpc.errors import CheckpointError
from mshpc.parallel.sharded_optim import STATE_KEYS
from mshpc.parallel.zero import ZeroEngine

log = logging.getLogger(__name__)


def checkpoint_root(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


class TrainCheckpointer:
    """Collective over the world: every rank calls `resume`, `maybe_save` and `close` alike."""

    def __init__(self, cfg: Config, root: Path, rank: int, world_size: int, engine: ZeroEngine,
                 scheduler: torch.optim.lr_scheduler.LRScheduler,
                 before_commit: Callable[[int], None] = lambda step: None) -> None:
        self.cfg, self.root, self.rank, self.world_size = cfg, root, rank, world_size
        self.engine, self.optimizer, self.scheduler = engine, engine.optimizer, scheduler
        # A CPU group of its own: the saver's thread talks on it while the loop uses the default one.
        self.group = dist.new_group(backend="gloo")
        p = cfg.parallel
        target = SaveTarget(root=root, keep=cfg.checkpoint.keep, config_hash=config_hash(cfg),
                            layout={"dp": p.dp, "tp": p.tp, "pp": p.pp})
        self.saver = CheckpointSaver(target, rank, self.group, cfg.checkpoint.async_save, before_commit)

    # ---------------------------------------------------------------- save

    def _extras(self, step: int) -> dict[str, Any]:
        return {
            "step": step, "world_size": self.world_size,
            "scheduler": self.scheduler.state_dict(),
            "group_lrs": [g["lr"] for g in self.optimizer.param_groups],
            "data": self._data_position(),
        }

    def _data_position(self) -> dict[str, int]:
        c = self.cfg
        return {"seed": c.data.seed, "global_batch": c.global_batch, "seq_len": c.model.seq_len}

    def maybe_save(self, step: int) -> float | None:
        """After `step` optimizer steps: save if the interval says so (or it is the last step);
        return the seconds the loop was blocked, or None when nothing was saved."""
        interval = self.cfg.checkpoint.interval_steps
        if interval == 0 or (step % interval and step != self.cfg.train.steps):
            return None
        return self.save(step)

    def save(self, step: int) -> float:
        """Save now, after `step` optimizer steps; return the seconds the loop was blocked."""
        self.engine.wait_params()  # the weights of this step, not half-gathered ones
        slices = {**rng_slices(self.rank), **self.engine.state_slices()}
        if self.engine.rank == 0:
            # The dp-replicated weights (dp rank 0's: each tp rank its own shards), for inference
            # and inspection; resume rebuilds them from the fp32 masters, so they are never read back.
            slices.update(model_slices(self.engine.model, self.engine.mp))
        return self.saver.save(step, slices, self._extras(step))

    def close(self) -> None:
        """Wait for the save in flight; raises if it failed."""
        self.saver.wait()

    # ---------------------------------------------------------------- resume

    def resume(self) -> int:
        """Install the checkpoint `train.resume` names; return the step to continue from."""
        mode = self.cfg.train.resume
        if mode == "never":
            return 0
        if mode == "auto":
            if self.rank == 0:
                remove_stale_tmp(self.root)
            folders = candidates(self.root)
        else:
            folders = [Path(mode)]
            if not folders[0].is_dir():
                raise CheckpointError(f"train.resume={mode!r}: no such checkpoint folder (or use 'auto'/'never')")
        manifest = resume_from(folders, self._stage, self.group)
        if manifest is None:
            return 0
        log.info("resumed from step %d (%s)", manifest.step, manifest.layout)
        return manifest.step

    def _stage(self, reader: CheckpointReader) -> Callable[[], None]:
        """Read and verify this rank's own shard of the state (1/dp of it: no two ranks read the
        same bytes) into the reader's cache, so installing it cannot fail half-way."""
        tp = reader.manifest.layout.get("tp", 1)
        if tp != self.cfg.parallel.tp:
            # tp shards are saved per tp rank (`<name>@tp<r>`), not as slices of the whole tensor
            raise CheckpointError(f"{reader.folder} was written at parallel.tp={tp}; resume it at "
                                  f"parallel.tp={tp} (this run has {self.cfg.parallel.tp})")
        for piece in self.engine.pieces:
            shape = reader.global_shape(f"master/{piece.key}")
            if shape != piece.shape:
                raise CheckpointError(f"{reader.folder}: master/{piece.key} has shape {shape}, "
                                      f"the model {piece.shape}")
            for prefix in ("master", *(f"optim.{k}" for k in STATE_KEYS)):
                reader.read(f"{prefix}/{piece.key}", piece.start, piece.tensor.numel())
        reader.read("optim.step", 0, 1)
        extras = reader.manifest.extras
        rng = stage_rng(reader, self.rank, same_world=extras.get("world_size") == self.world_size)

        def install() -> None:
            self.engine.load_state_slices(reader.read)  # collective over dp: re-gathers the weights
            apply_rng(rng)
            self.scheduler.load_state_dict(extras["scheduler"])
            for group, lr in zip(self.optimizer.param_groups, extras["group_lrs"]):
                group["lr"] = lr
            if extras.get("data") != self._data_position():
                log.warning("data settings changed since the checkpoint (%s -> %s): the data order "
                            "from here on differs from the original run's", extras.get("data"),
                            self._data_position())

        return install
