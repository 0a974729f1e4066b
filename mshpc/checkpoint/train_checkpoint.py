"""The train loop's view of checkpoints: resume at start-up, save every N steps, wait at the end."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mshpc.checkpoint.paths import remove_stale_tmp
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.restore import candidates, resume_from
from mshpc.checkpoint.saver import CheckpointSaver, SaveTarget
from mshpc.checkpoint.state import (apply_model, apply_optimizer, apply_rng, model_slices,
                                    optimizer_slices, rng_slices, stage_replicated, stage_rng)
from mshpc.config import Config, config_hash
from mshpc.errors import CheckpointError

log = logging.getLogger(__name__)


def checkpoint_root(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


class TrainCheckpointer:
    """Collective over the world: every rank calls `resume`, `maybe_save` and `close` alike."""

    def __init__(self, cfg: Config, root: Path, rank: int, world_size: int, device: torch.device,
                 model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler,
                 before_commit: Callable[[int], None] = lambda step: None) -> None:
        self.cfg, self.root, self.rank, self.world_size, self.device = cfg, root, rank, world_size, device
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
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
        slices = rng_slices(self.rank)
        if self.rank == 0:  # replicated state: one writer for the replica group
            slices.update(model_slices(self.model))
            slices.update(optimizer_slices(self.model, self.optimizer))
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
        params = dict(self.model.named_parameters())
        for name, p in params.items():
            if reader.global_shape(f"model/{name}") != tuple(p.shape):
                raise CheckpointError(f"{reader.folder}: model/{name} has shape "
                                      f"{reader.global_shape(f'model/{name}')}, the model {tuple(p.shape)}")
        names = reader.names("model/") + reader.names("optim.")
        staged = stage_replicated(reader, names, is_reader=self.rank == 0)
        extras = reader.manifest.extras
        rng = stage_rng(reader, self.rank, same_world=extras.get("world_size") == self.world_size)

        def install() -> None:
            apply_model(self.model, staged, self.device, src=0, group=None)
            apply_optimizer(self.model, self.optimizer, reader, staged, self.device, src=0, group=None)
            apply_rng(rng)
            self.scheduler.load_state_dict(extras["scheduler"])
            for group, lr in zip(self.optimizer.param_groups, extras["group_lrs"]):
                group["lr"] = lr
            if extras.get("data") != self._data_position():
                log.warning("data settings changed since the checkpoint (%s -> %s): the data order "
                            "from here on differs from the original run's", extras.get("data"),
                            self._data_position())

        return install
