"""A rank's entry (`train`) and the train loop (`run_training`): the parts built once
(`build_parts`), then per step the data, `optimizer_step`, `evaluate_if_due`, the save,
`report_step` and `stop_if_asked` (docs/DESIGN.md, One training step)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mshpc import full_disk
from mshpc.batch import Batch
from mshpc.checkpoint.paths import checkpoint_root, committed_steps, latest_step
from mshpc.checkpoint.train_checkpoint import TrainCheckpointer
from mshpc.config import (
    Config,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    config_hash,
    dump_yaml,
    resolve_world,
    to_dict,
)
from mshpc.cpu_ranks.tunings import select_cpu_tunings
from mshpc.data.loader import BatchLoader
from mshpc.data.node_reader import ReaderScope
from mshpc.data.pipeline import build_loader
from mshpc.data.sampler import SequenceSampler
from mshpc.data.sources import DataSources, adopt_tokenizer, log_blend, open_sources, source_paths
from mshpc.data.tokenizer_dir import describe, record_tokenizer
from mshpc.data.window_record import record_path
from mshpc.diagnose.collector import Collector, build_collector
from mshpc.diagnose.mfu import mfu
from mshpc.diagnose.timers import phase
from mshpc.errors import ConfigError, MshpcError
from mshpc.evaluate import Evaluator, build_evaluator
from mshpc.events import append_event
from mshpc.fault_hooks import NO_FAULTS, FaultHooks
from mshpc.fault_setup import build_fault_hooks
from mshpc.interop.hf_import import initial_model
from mshpc.launch.env import LaunchEnv, SupervisorLink
from mshpc.launch.heartbeat import Heartbeat, start_heartbeat
from mshpc.launch.rejoin import abort_communicators, rejoin
from mshpc.launch.rendezvous import DistInfo, init_distributed, shutdown_distributed
from mshpc.launch.requeue import PreemptionWatcher, watch_signals
from mshpc.launch.run_claim import claim_run_dir
from mshpc.launch.runtime import Runtime, build_runtime, max_memory_gib, uses_bf16, uses_cuda
from mshpc.loggers.sinks import Loggers, build_loggers
from mshpc.loss_check import check_loss
from mshpc.mesh_shape import MeshShape
from mshpc.optim.schedule import build_scheduler
from mshpc.parallel import comm
from mshpc.parallel.apply import LossFn, parallelize
from mshpc.parallel.compile_blocks import compile_seconds
from mshpc.parallel.expert_load import ExpertLoad, load_metrics
from mshpc.parallel.mesh import Mesh, build_mesh
from mshpc.parallel.pipeline import build_pipeline, pipeline_train_step
from mshpc.parallel.update import clipped_update
from mshpc.parallel.zero import ZeroEngine
from mshpc.phases import BACKWARD, CHECKPOINT, COMPILE, DATA, EVAL, FORWARD, STEP
from mshpc.plan.auto_layout import fit_layout, host_memory_bytes, rank_device_spec, smallest_over_world
from mshpc.plan.report import fit_warning, memory_refusal
from mshpc.progress import Kept, Progress, summary_lines
from mshpc.run_dir import create_run_dir, run_path
from mshpc.save_schedule import SaveSchedule
from mshpc.snapshot.keeper import SnapshotKeeper, StepGuard
from mshpc.snapshot.restore import Restored
from mshpc.snapshot.state import TrainState

log = logging.getLogger(__name__)

StepFn = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]  # batch -> (loss, grad norm)


def fit_to_world(cfg: Config, info: DistInfo) -> Config:
    """The config's layout fitted to the launched world: dp = world / (tp * pp) under
    parallel.layout manual; under auto, the plan's fastest layout that fits this world's smallest
    device, logged in one line by rank 0. Collective over the world (auto)."""
    if cfg.parallel.layout == "auto":
        use_cuda = uses_cuda(cfg.train)
        if use_cuda:
            torch.cuda.set_device(info.local_rank)  # the figures' all-reduce runs on it under NCCL
        dev = rank_device_spec(use_cuda, uses_bf16(cfg.train, use_cuda), info.local_rank,
                               info.local_world_size, cfg.train.cpu_threads)
        device = torch.device("cuda", info.local_rank) if use_cuda else torch.device("cpu")
        dev, per_node = smallest_over_world(dev, info.local_world_size, device)
        parallel, train, line = fit_layout(info.world_size, dev, per_node, model_cfg=cfg.model,
                                           parallel=cfg.parallel, train=cfg.train, optim=cfg.optim, plan_cfg=cfg.plan)
        cfg = dataclasses.replace(cfg, parallel=parallel, train=train)
        if info.rank == 0:
            log.info(line)
    return resolve_world(cfg, info.world_size)


def refuse_if_absurd(cfg: Config, rt: Runtime, info: DistInfo) -> None:
    """A ConfigError on every rank alike when the config needs far more memory than this rank's
    device has (plan/report.py), before anything is allocated for it."""
    if rt.device.type == "cuda":
        props = torch.cuda.get_device_properties(rt.device)
        have, name = props.total_memory, props.name
    else:
        have, name = host_memory_bytes() // info.local_world_size, f"this host's memory / {info.local_world_size} ranks"
    line = memory_refusal(have, name, 2 if rt.autocast_dtype is not None else 4, model_cfg=cfg.model,
                          parallel=cfg.parallel, train=cfg.train)
    if line is not None:
        raise ConfigError(line)


def warn_if_unfit(cfg: Config, rt: Runtime) -> None:
    """Log a warning at start-up when `mshpc plan`'s memory model says the layout will not fit
    on this GPU. On CPU host memory is not what such a layout runs out of, so nothing is said."""
    if rt.device.type != "cuda":
        return
    props = torch.cuda.get_device_properties(rt.device)
    warning = fit_warning(props.total_memory, props.name, model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train,
                          plan_cfg=cfg.plan)
    if warning is not None:
        log.warning(warning)


def open_data(cfg: Config, info: DistInfo, fresh: bool,
              verify: bool = True) -> tuple[DataSources, list[tuple[Path, float]]]:
    """The run's token sources. Rank 0 first prepares the embedded corpus if needed, adopts the
    data's tokenizer (data/sources.py), keeps it in the run directory and checks it against the
    model (and, with `verify`, the shards' sums); the others wait for its verdict. Collective
    over the world."""
    error = None
    if info.rank == 0:
        try:
            tokenizer = adopt_tokenizer(cfg.data, source_paths(cfg.data))
            if tokenizer.vocab_size > cfg.model.vocab_size:
                raise ConfigError(
                    f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                    f"vocabulary ({tokenizer.vocab_size}); set model.vocab_size >= {tokenizer.vocab_size}")
            record_tokenizer(tokenizer, run_path(cfg.run), fresh)
            log.info("tokenizer: %s", describe(tokenizer))
        except MshpcError as exc:
            error = exc
    comm.raise_if_any_failed(error, "opening the data")
    paths = source_paths(cfg.data)
    return open_sources(cfg.data, paths, "train", verify and info.rank == 0, cfg.model.vocab_size), paths


def train_step(engine: ZeroEngine, loss_fn: LossFn, batch: Batch, rt: Runtime, *, train: TrainConfig,
               optim: OptimConfig, parallel: ParallelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over the dp rank's batch (grad_accum micro-batches; the tp ranks of one
    dp rank see the same batch); collective over the mesh. Returns the loss averaged over the
    global batch and the global grad norm before clipping."""
    batch = batch.to(rt.device, non_blocking=True)  # (grad_accum * micro_batch, seq_len + 1)
    loss_sum = torch.zeros((), device=rt.device)
    micros = batch.split(train.micro_batch)
    for i, micro in enumerate(micros):
        # bf16 autocast on GPU: the parameters and their gradients stay fp32, so the engine
        # accumulates and reduces gradients in fp32
        with phase(FORWARD), torch.autocast(rt.device.type, dtype=rt.autocast_dtype,
                                              enabled=rt.autocast_dtype is not None):
            loss = loss_fn(engine.model(micro.inputs, micro.segments), micro.targets) / train.grad_accum
        with phase(BACKWARD):
            engine.backward(loss, sync=i == len(micros) - 1)  # communicate on the last micro-batch only
        loss_sum += loss.detach()
    # every rank of a dp group holds the same tp-reduced loss: summed over the dp group
    return clipped_update(engine, loss_sum, grad_clip=optim.grad_clip, loss_group=engine.group,
                          loss_terms=parallel.dp)


def compile_report(cfg: TrainConfig, first_step: bool, rank: int) -> dict[str, float]:
    """The first step's compile time under train.compile (blocks compile on first use, their
    backward in the first backward): one line on rank 0, and compile_s in the step's row."""
    if not (cfg.compile and first_step):
        return {}
    compile_s = compile_seconds()
    if rank == 0:
        log.info("train.compile: the first step spent %.1f s compiling the blocks", compile_s)
    return {"compile_s": compile_s}


def build_data(cfg: Config, info: DistInfo, mesh: Mesh, rt: Runtime, start_step: int,
               verify: bool = True) -> BatchLoader:
    """This rank's loader: every tp rank and pipeline stage of a dp replica reads its batch.
    Collective over the world (the tokenizer's verdict, the per-node reader's start-up)."""
    data, paths = open_data(cfg, info, fresh=start_step == 0, verify=verify)
    if info.rank == 0:
        log_blend(data, paths, data.sampler(cfg.model.seq_len, cfg.global_batch, cfg.data.seed), cfg.train.steps)
    record = record_path(run_path(cfg.run), info.rank) if cfg.data.record_windows else None
    loader = build_loader(cfg.data, data, cfg.model.seq_len, cfg.global_batch, mesh.coords.dp,
                          cfg.parallel.dp, start_step, rt.device, ReaderScope(node=info.node), record)
    if info.rank == 0:
        log.info("data loader: %s", loader.description)
    return loader


def build_model_step(cfg: Config, mesh: Mesh, rt: Runtime) -> tuple[ZeroEngine, StepFn]:
    """This rank's ZeRO engine over its part of the model (tp/sp, recompute, ZeRO applied), and
    its train step (a pipeline rank's when pp > 1). Collective over the mesh."""
    torch.manual_seed(cfg.train.seed)  # identical on every rank: identical initial weights
    model = initial_model(cfg.model, cfg.train.init_from)
    parallel, train, optim = cfg.parallel, cfg.train, cfg.optim
    if parallel.pp > 1:
        pipe = build_pipeline(mesh, rt.device, rt.autocast_dtype, model, model_cfg=cfg.model, parallel=parallel,
                              train=train, optim=optim)
        return pipe.engine, lambda batch: pipeline_train_step(pipe, batch.to(rt.device), train=train, optim=optim,
                                                              parallel=parallel)
    split = parallelize(model.to(rt.device), mesh, model_cfg=cfg.model, parallel=parallel, train=train, optim=optim)
    return split.engine, lambda batch: train_step(split.engine, split.loss_fn, batch, rt, train=train, optim=optim,
                                                  parallel=parallel)


def moe_row(load: ExpertLoad | None, model_cfg: ModelConfig) -> dict[str, Any]:
    """The step's mixture-of-experts metrics (load per expert and layer, imbalance, dropped
    tokens, router losses), the router biases moved; {} for a dense model. Collective over the world."""
    if load is None or model_cfg.moe is None:
        return {}
    layers = [i for i in range(model_cfg.n_layer) if model_cfg.is_moe_layer(i)]
    return load_metrics(load.after_step(), model_cfg.moe, layers)


def build_eval(cfg: Config, info: DistInfo, mesh: Mesh, rt: Runtime, engine: ZeroEngine) -> Evaluator | None:
    """This rank's evaluator of the held-out split, or None with eval.interval_steps 0. After
    build_data (rank 0 prepares the embedded corpus there). Collective over the pp group."""
    if cfg.eval.interval_steps == 0:
        return None
    val = open_sources(cfg.data, source_paths(cfg.data), "val", info.rank == 0, cfg.model.vocab_size)
    evaluator = build_evaluator(mesh, engine, val, rt.device, rt.autocast_dtype, eval_cfg=cfg.eval,
                                model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train, data=cfg.data)
    if evaluator.warning is not None and info.rank == 0:
        log.warning(evaluator.warning)
    return evaluator


def open_loggers(cfg: Config, info: DistInfo, start_step: int) -> tuple[Path | None, Loggers | None]:
    """Rank 0's run directory and loggers (None elsewhere). Collective over the world: a logger
    that cannot start stops every rank at start-up with its one line."""
    error = None
    out: tuple[Path | None, Loggers | None] = (None, None)
    if info.rank == 0:
        try:
            run_dir = run_path(cfg.run)
            metrics = create_run_dir(run_dir, dump_yaml(cfg), start_step)
            p = cfg.parallel
            append_event(run_dir, "train_start", attempt=metrics.attempt, start_step=start_step,
                         world=info.world_size, layout={"dp": p.dp, "tp": p.tp, "pp": p.pp})
            out = run_dir, build_loggers(run_dir, metrics, start_step, run=cfg.run, config_record=to_dict(cfg))
        except MshpcError as exc:
            error = exc
    comm.raise_if_any_failed(error, "starting the loggers")
    return out


@dataclass
class Parts:
    """What the loop runs, built by `build_parts`, closed by `close` whatever happened."""

    engine: ZeroEngine
    step_fn: StepFn
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ckpt: TrainCheckpointer
    start_step: int  # optimizer steps done before this process's first (0: a fresh run)
    loader: BatchLoader
    evaluator: Evaluator | None
    loggers: Loggers | None  # rank 0's
    run_dir: Path | None  # rank 0's, once its loggers have started
    diag: Collector
    progress: Progress
    load: ExpertLoad | None  # a mixture of experts' load statistics and router biases (None: dense)
    state: TrainState  # what a snapshot holds of the engine and the schedule
    keeper: SnapshotKeeper | None = None  # this rank's in-memory snapshots (recovery.snapshots)
    guard: StepGuard | None = None  # the replay of suspicious steps (recovery.replay)

    def close(self) -> None:
        self.progress.close()
        self.diag.close()
        self.loader.close()
        if self.evaluator is not None:
            self.evaluator.close()
        if self.loggers is not None:
            self.loggers.close()


def build_parts(cfg: Config, info: DistInfo, rt: Runtime, faults: FaultHooks, keeper: SnapshotKeeper | None = None,
                restore: bool = False) -> Parts:
    """The mesh, the model and its step, the schedule, the checkpointer (resumed, or with `restore`
    the in-memory snapshots of a recovery in place), the data, the evaluator, the loggers and the
    timers' collector, in that order. Collective over the world."""
    p = cfg.parallel
    mesh = build_mesh(MeshShape(pp=p.pp, dp=p.dp, tp=p.tp, ep=p.ep))  # every group, once
    engine, step_fn = build_model_step(cfg, mesh, rt)
    load = ExpertLoad(engine.model, cfg.model.moe, cfg.model.n_layer) if cfg.model.moe else None
    scheduler = build_scheduler(engine.optimizer, cfg.optim, cfg.train.steps)  # over this rank's fp32 shard
    # Per-rank dropout masks, as DP needs; tp ranks drop out of different tokens (sequence
    # parallelism) or heads, so theirs differ too.
    torch.manual_seed(cfg.train.seed + info.rank)
    run_dir = run_path(cfg.run)
    ckpt = TrainCheckpointer(checkpoint_root(cfg.checkpoint, run_dir), info.rank, engine, scheduler, run_dir=run_dir,
                             config_hash=config_hash(cfg), config_record=to_dict(cfg), checkpoint=cfg.checkpoint,
                             parallel=cfg.parallel,
                             train=cfg.train, data=cfg.data, model_cfg=cfg.model, recovery=cfg.recovery,
                             before_commit=faults.before_commit, before_write=faults.before_write)
    start_step = 0 if restore else ckpt.resume()
    state = TrainState(engine, scheduler)
    if keeper is not None:
        start_step = begin_snapshots(keeper, state, mesh, start_step, restore, info.rank == 0, cfg, faults)
    faults.install_slowdown(engine.model, start_step, cfg.train.grad_accum)
    guard = (StepGuard(cfg.recovery, keeper, state, engine.model, rt.device, run_dir if info.rank == 0 else None)
             if keeper is not None and cfg.recovery.replay else None)  # after the faults: their hooks first
    loader = build_data(cfg, info, mesh, rt, start_step, verify=not restore)  # checked by the first generation
    evaluator = build_eval(cfg, info, mesh, rt, engine)
    log_dir, loggers = open_loggers(cfg, info, start_step)
    diag = build_collector(run_dir, info.rank, info.node, rt.device, start_step, rt.peak_tflops,
                           diagnose=cfg.diagnose, model_cfg=cfg.model, parallel=cfg.parallel)
    progress = build_progress(cfg, info, start_step)
    return Parts(engine, step_fn, scheduler, ckpt, start_step, loader, evaluator, loggers, log_dir, diag, progress,
                 load, state, keeper, guard)


@dataclass
class StepFigures:
    """What one step measured, for its row."""

    loss: float  # the global mean loss
    grad_norm: torch.Tensor  # before clipping (read only when the row is written: no device sync per step)
    lr: float  # the step's learning rate
    stage1_wait_s: float | None  # the update's wait for the previous save's stage 1 (None: none)
    compiled: dict[str, float]  # compile_s on train.compile's first step
    experts: dict[str, Any]  # a mixture of experts' load and router figures ({} for a dense model)
    validation: dict[str, float] = field(default_factory=dict)  # val_loss, val_ppl, eval_s when due
    blocking_s: float | None = None  # the loop's wait for this step's save; None when the step saved nothing
    step_time_s: float = 0.0  # the training step's own time: validation left out
    data_wait_s: float = 0.0


@contextmanager
def loop_phase(beat: Heartbeat, name: str, step: int) -> Iterator[None]:
    """Phase `name` of step `step` (0-based), for the heartbeat (hang detection) and the timers alike."""
    beat.phase(name, step)
    with phase(name):
        yield


def run_training(cfg: Config, info: DistInfo, rt: Runtime, watcher: PreemptionWatcher,
                 faults: FaultHooks = NO_FAULTS, beat: Heartbeat | None = None,
                 keeper: SnapshotKeeper | None = None, restore: bool = False) -> list[float]:
    """The loop itself; returns the global mean loss of every step this process trained. With a
    snapshot keeper (recovery.*) it snapshots every step, and `restore` starts from the snapshots
    of a recovery in place instead of the disk checkpoint."""
    parts = build_parts(cfg, info, rt, faults, keeper, restore)
    beat = beat or open_heartbeat(cfg, None, info)
    losses: list[float] = []
    try:
        for step in range(parts.start_step, cfg.train.steps):
            done = step + 1  # optimizer steps done once this one ends: what rows, saves and evaluations count
            started, waited = time.perf_counter(), parts.loader.wait_s
            parts.diag.begin_step(done)
            with loop_phase(beat, DATA, step):
                batch = next(parts.loader)
            figures = optimizer_step(cfg, parts, batch, step, beat, faults, info.rank)
            losses.append(figures.loss)
            figures.validation = evaluate_if_due(parts.evaluator, step, done, beat)  # after the loss check
            with loop_phase(beat, CHECKPOINT, step):  # stage 1 overlaps the next forward and backward
                figures.blocking_s = parts.ckpt.save(done) if parts.ckpt.schedule.due(done) else None
            figures.step_time_s = time.perf_counter() - started - figures.validation.get("eval_s", 0.0)
            figures.data_wait_s = parts.loader.wait_s - waited
            report_step(cfg, parts, rt, info.world_size, done, figures)
            stop_if_asked(watcher, parts.ckpt, done, info.rank)
        parts.ckpt.close()
        if parts.keeper is not None:
            parts.keeper.close()
        parts.diag.close(final_step=cfg.train.steps)  # the last straggler look sees every rank's last step
    except BaseException:
        settle_save_in_flight(parts.ckpt, beat)
        if parts.keeper is not None:
            parts.keeper.end()  # its slots are what a recovery in place restores from
        raise
    finally:
        parts.close()
    if parts.run_dir is not None:
        kept = kept_checkpoints(cfg, parts.run_dir)
        for line in summary_lines(parts.progress.tally, cfg.train.steps, parts.progress.elapsed_s(),
                                  cfg.global_batch * cfg.model.seq_len, parts.run_dir, kept):
            log.info(line)
    return losses


def kept_checkpoints(cfg: Config, run_dir: Path) -> Kept:
    """The checkpoints the run leaves, for its summary."""
    root = checkpoint_root(cfg.checkpoint, run_dir)
    return Kept(root, latest_step(root), len(committed_steps(root)))


def optimizer_step(cfg: Config, parts: Parts, batch: Batch, step: int, beat: Heartbeat, faults: FaultHooks,
                   rank: int) -> StepFigures:
    """Forward, backward and update of step `step` (0-based), then the loss check. Collective
    over the world."""
    first = step == parts.start_step
    # the first step compiles (train.compile): a long phase for hang detection, like a save
    beat.phase(COMPILE if cfg.train.compile and first else STEP, step)
    faults.at_step(step)
    experts: dict[str, Any] = {}

    def once() -> tuple[torch.Tensor, torch.Tensor]:
        out = parts.step_fn(batch)
        experts.update(moe_row(parts.load, cfg.model))  # before the next step: the router biases move
        return out

    loss, grad_norm = once()
    if parts.guard is not None:  # a suspicious step is replayed (once() again); its replay's result may be kept
        loss, grad_norm = parts.guard.check(step, loss, grad_norm, once)
    figures = StepFigures(loss.item(), grad_norm, float(parts.scheduler.get_last_lr()[0]),
                          parts.ckpt.pop_stage1_wait(), compile_report(cfg.train, first, rank), experts)
    parts.scheduler.step()
    # the loss is all-reduced: every rank raises alike, before a NaN can be saved
    check_loss(figures.loss, step, cfg.supervisor.loss_limit)
    if parts.keeper is not None:  # after the loss check: a diverged state is never a snapshot
        parts.keeper.after_step(step + 1, parts.state)
    return figures


def evaluate_if_due(evaluator: Evaluator | None, step: int, done: int, beat: Heartbeat) -> dict[str, float]:
    """Validation once `done` steps are done, when eval.interval_steps says so: its figures for the
    step's row. Its own phase: never blamed as a straggler, timed as a long phase by hang
    detection. Collective over the world."""
    if evaluator is None or not evaluator.due(done):
        return {}
    start = time.perf_counter()
    with loop_phase(beat, EVAL, step):
        loss = evaluator.evaluate()
    return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else math.inf,
            "eval_s": time.perf_counter() - start}


def report_step(cfg: Config, parts: Parts, rt: Runtime, world_size: int, done: int, figures: StepFigures) -> None:
    """Close the timers of the step that made it `done` steps (every rank); rank 0 writes its row
    every run.log_interval_steps (and whenever it validated or compiled), and the progress line."""
    tokens_per_s = cfg.global_batch * cfg.model.seq_len / figures.step_time_s
    step_mfu = mfu(tokens_per_s, cfg.model, world_size, rt.peak_tflops)
    tflops = parts.diag.end_step(done, tokens_per_s)
    if parts.loggers is not None and (done % cfg.run.log_interval_steps == 0 or figures.validation or figures.compiled):
        parts.loggers.write({
            "step": done, "loss": figures.loss, "lr": figures.lr, "grad_norm": figures.grad_norm.item(),
            "tokens_per_s": tokens_per_s, "step_time_s": figures.step_time_s, "mfu": step_mfu, "tflops": tflops,
            "data_wait_s": figures.data_wait_s, "ckpt_blocking_s": figures.blocking_s,
            "ckpt_stage1_wait_s": figures.stage1_wait_s, "max_memory_gib": max_memory_gib(rt),
            **figures.validation, **figures.compiled, **figures.experts,
        })
    parts.progress.update(done, figures.loss, tokens_per_s, step_mfu, figures.lr)
    if figures.validation:
        parts.progress.validation(done, figures.validation)


def stop_if_asked(watcher: PreemptionWatcher, ckpt: TrainCheckpointer, done: int, rank: int) -> None:
    """The stop vote, collective over the world: when any rank was signalled, every rank saves
    (unless this step just did), waits for the save, and stops (rank 0 requeues if asked);
    raises JobStopped. The stop's save must succeed: one that failed at this step (a full disk
    skipped under recovery.in_place) is tried again, and a failure now ends the run."""
    stop = watcher.should_stop()
    if stop is None:
        return
    if ckpt.saved_step != done:
        ckpt.save(done, must_succeed=True)
    ckpt.close()
    watcher.stop(stop, rank)


def begin_snapshots(keeper: SnapshotKeeper, state: TrainState, mesh: Mesh, start_step: int, restore: bool,
                    first: bool, cfg: Config, faults: FaultHooks) -> int:
    """This generation's snapshots (restored from the last one's when `restore`); returns the
    step to train from. Collective over the world. Rank 0 (`first`) tells what was restored."""
    began = time.perf_counter()
    start_step, restored = keeper.begin(state, mesh.shape, start_step, restore, faults)
    if first and restored is not None:
        report_restored(restored, time.perf_counter() - began, cfg)
    return start_step


def report_restored(restored: Restored, seconds: float, cfg: Config) -> None:
    append_event(run_path(cfg.run), "snapshot_restore", step=restored.step, seconds=round(seconds, 3),
                 problems=list(restored.problems))
    log.info("recovered in place: every rank restored its snapshot of step %d in %.2f s%s", restored.step, seconds,
             f" ({'; '.join(restored.problems)})" if restored.problems else "")


def build_progress(cfg: Config, info: DistInfo, start_step: int) -> Progress:
    """Rank 0's console (run.progress), with the dataset's windows for its epoch notices; the
    other ranks show nothing. After build_data, which prepares the embedded corpus."""
    if info.rank != 0:
        return Progress(cfg.train.steps, "none", start_step=start_step)
    data = open_sources(cfg.data, source_paths(cfg.data), "train", False, cfg.model.vocab_size)
    try:  # a blend's epochs are its sources' own (log_blend says them at the start): no notice
        sampler = data.sampler(cfg.model.seq_len, cfg.global_batch, cfg.data.seed)
        windows = sampler.n_windows if isinstance(sampler, SequenceSampler) else None
    finally:
        data.close()
    return Progress(cfg.train.steps, cfg.run.progress, start_step=start_step, windows_per_epoch=windows,
                    global_batch=cfg.global_batch)


def settle_save_in_flight(ckpt: TrainCheckpointer, beat: Heartbeat) -> None:
    """Before a failing rank leaves: its background save runs collectives, and exiting under
    them crashed the rank (SIGSEGV), which the supervisor reported in place of the error. The
    wait is the save's phase, with the save's timeout: a long save is no hang."""
    step = ckpt.in_flight_step
    if step is not None:
        beat.phase(CHECKPOINT, step - 1)  # the phase of the step that saved (0-based)
        ckpt.close_after_error()


def open_heartbeat(cfg: Config, link: SupervisorLink | None, info: DistInfo) -> Heartbeat:
    """This rank's heartbeat (to the supervisor at `link`; silent without one)."""
    return start_heartbeat(link, info.rank, info.node, parallel=cfg.parallel, supervisor=cfg.supervisor,
                           saves=SaveSchedule.of(checkpoint=cfg.checkpoint, train=cfg.train))


def train(cfg: Config, env: LaunchEnv) -> list[float]:
    """Entry point for one rank: bootstrap, fit the config to the world, train, shut down. Under
    recovery.in_place a generation that fails because a peer was lost is followed, in this
    process, by the next one the supervisor starts (mshpc/launch/rejoin.py)."""
    run_dir = run_path(cfg.run)
    checkpoints = checkpoint_root(cfg.checkpoint, run_dir)
    full_disk.hold_for(cfg.recovery.full_disk_hold_s)  # the run files' lines a full disk refuses
    # first: a signal during start-up must not kill the rank
    watcher = watch_signals(env, slurm=cfg.slurm, run_dir=run_dir, checkpoints=checkpoints)
    try:
        info = init_distributed(env)
        fitted = fit_to_world(cfg, info)
        with open_heartbeat(fitted, env.supervisor, info) as beat:
            beat.on_abort = abort_communicators
            rt = build_runtime(fitted.train, info)
            refuse_if_absurd(fitted, rt, info)  # before the data, the model or the run directory
            select_cpu_tunings(rt.device)  # before the model: its optimizer and collectives follow it
            keeper = SnapshotKeeper(cfg.recovery, info.node, rt.device) if cfg.recovery.snapshots else None
            while True:
                try:
                    return train_generation(fitted, env, info, rt, watcher, beat, keeper)
                except BaseException as exc:
                    env = rejoin(exc, env, beat, cfg.recovery.in_place, cfg.supervisor.setup_timeout_s)
                info = init_distributed(env)  # the new generation's groups
                fitted = fit_to_world(cfg, info)
    finally:
        watcher.close()
        shutdown_distributed()


def train_generation(cfg: Config, env: LaunchEnv, info: DistInfo, rt: Runtime, watcher: PreemptionWatcher,
                     beat: Heartbeat, keeper: SnapshotKeeper | None) -> list[float]:
    """One generation of this rank's training: the first, or one that recovers in place."""
    run_dir = run_path(cfg.run)
    faults = build_fault_hooks(env, info, run_dir, checkpoint_root(cfg.checkpoint, run_dir))
    generation = env.supervisor.generation if env.supervisor is not None else 0
    with claim_run_dir(run_dir, info, rt):  # before anything is written there
        if info.rank == 0 and generation == 0:
            warn_if_unfit(cfg, rt)
        return run_training(cfg, info, rt, watcher, faults, beat, keeper, restore=generation > 0)
