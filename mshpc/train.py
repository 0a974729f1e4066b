"""The train loop: ties launch, data, model, data parallelism, optimizer and metrics together."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mshpc.batch import Batch
from mshpc.checkpoint.paths import checkpoint_root
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
from mshpc.data.sources import DataSources, adopt_tokenizer, log_blend, open_sources, source_paths
from mshpc.data.tokenizer_dir import describe, record_tokenizer
from mshpc.diagnose.collector import build_collector
from mshpc.diagnose.mfu import mfu, peak_tflops
from mshpc.diagnose.timers import EVAL, phase
from mshpc.errors import ConfigError, MshpcError
from mshpc.evaluate import Evaluator, build_evaluator
from mshpc.fault_hooks import NO_FAULTS, FaultHooks
from mshpc.fault_setup import build_fault_hooks
from mshpc.interop.hf_import import initial_model
from mshpc.launch.env import LaunchEnv, SupervisorLink
from mshpc.launch.heartbeat import Heartbeat, start_heartbeat
from mshpc.launch.rendezvous import DistInfo, init_distributed, shutdown_distributed
from mshpc.launch.requeue import PreemptionWatcher, watch_signals
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
from mshpc.plan.auto_layout import fit_layout, rank_device_spec, smallest_over_world
from mshpc.plan.report import fit_warning
from mshpc.progress import Progress
from mshpc.run_dir import create_run_dir, run_path
from mshpc.run_lock import (
    LOCK_FILE,
    RunLockError,
    check_run_lock,
    hold_run_lock,
    inherited_token,
    read_holder,
    token_digest,
)
from mshpc.save_schedule import SaveSchedule

log = logging.getLogger(__name__)

StepFn = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]  # batch -> (loss, grad norm)


@dataclass(frozen=True)
class Runtime:
    """Where and in what precision this rank computes, decided once at start-up."""

    device: torch.device
    autocast_dtype: torch.dtype | None  # None: plain fp32
    peak_tflops: float | None


def uses_cuda(cfg: TrainConfig) -> bool:
    """Whether this rank computes on its GPU (train.device); a ConfigError when asked to and none is seen."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA device is visible (choose 'auto' or 'cpu')")
    return use_cuda


def uses_bf16(cfg: TrainConfig, use_cuda: bool) -> bool:
    return cfg.dtype == "bf16" or (cfg.dtype == "auto" and use_cuda)


def build_runtime(cfg: TrainConfig, info: DistInfo) -> Runtime:
    use_cuda = uses_cuda(cfg)
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
        device, name = torch.device("cuda", info.local_rank), torch.cuda.get_device_name()
    else:
        # Ranks on one host share its cores; oversubscribing threads slows every rank.
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(cfg.cpu_threads or max(1, cores // info.local_world_size))
        device, name = torch.device("cpu"), "cpu"
    bf16 = uses_bf16(cfg, use_cuda)
    peak = cfg.peak_tflops if cfg.peak_tflops is not None else peak_tflops(name, "bf16" if bf16 else "fp32")
    return Runtime(device=device, autocast_dtype=torch.bfloat16 if bf16 else None, peak_tflops=peak)


def max_memory_gib(rt: Runtime) -> float | None:
    """The most device memory this rank's tensors have held so far (None on CPU)."""
    return torch.cuda.max_memory_allocated(rt.device) / 2**30 if rt.device.type == "cuda" else None


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
                                           parallel=cfg.parallel, train=cfg.train, optim=cfg.optim)
        cfg = dataclasses.replace(cfg, parallel=parallel, train=train)
        if info.rank == 0:
            log.info(line)
    return resolve_world(cfg, info.world_size)


def warn_if_unfit(cfg: Config, rt: Runtime) -> None:
    """Log a warning at start-up when `mshpc plan`'s memory model says the layout will not fit
    on this GPU. On CPU host memory is not what such a layout runs out of, so nothing is said."""
    if rt.device.type != "cuda":
        return
    props = torch.cuda.get_device_properties(rt.device)
    warning = fit_warning(props.total_memory, props.name, model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train)
    if warning is not None:
        log.warning(warning)


def open_data(cfg: Config, info: DistInfo, fresh: bool) -> tuple[DataSources, list[tuple[Path, float]]]:
    """The run's token sources. Rank 0 first prepares the embedded corpus if needed, adopts the
    data's tokenizer (data/sources.py), keeps it in the run directory and checks it against the
    model; the others wait for its verdict. Collective over the world."""
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
    return open_sources(cfg.data, paths, "train", info.rank == 0, cfg.model.vocab_size), paths


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
        with phase("forward"), torch.autocast(rt.device.type, dtype=rt.autocast_dtype,
                                              enabled=rt.autocast_dtype is not None):
            loss = loss_fn(engine.model(micro.inputs, micro.segments), micro.targets) / train.grad_accum
        with phase("backward"):
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


def build_data(cfg: Config, info: DistInfo, mesh: Mesh, rt: Runtime, start_step: int) -> BatchLoader:
    """This rank's loader: every tp rank and pipeline stage of a dp replica reads its batch.
    Collective over the world (the tokenizer's verdict, the per-node reader's start-up)."""
    data, paths = open_data(cfg, info, fresh=start_step == 0)
    if info.rank == 0:
        log_blend(data, paths, data.sampler(cfg.model.seq_len, cfg.global_batch, cfg.data.seed), cfg.train.steps)
    loader = build_loader(cfg.data, data, cfg.model.seq_len, cfg.global_batch, mesh.coords.dp,
                          cfg.parallel.dp, start_step, rt.device, ReaderScope(node=info.node))
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
    return build_evaluator(mesh, engine, val, rt.device, rt.autocast_dtype, eval_cfg=cfg.eval, model_cfg=cfg.model,
                           parallel=cfg.parallel, train=cfg.train, data=cfg.data)


def run_eval(evaluator: Evaluator | None, step: int, beat: Heartbeat) -> tuple[dict[str, float], float]:
    """Validation after step `step` (0-based) when it is due: its metrics and its seconds. Its
    own phase for the timers and the heartbeat: never blamed as a straggler, timed as a long
    phase by hang detection. Collective over the world."""
    if evaluator is None or not evaluator.due(step + 1):
        return {}, 0.0
    beat.phase("eval", step)
    start = time.perf_counter()
    with phase(EVAL):
        loss = evaluator.evaluate()
    eval_s = time.perf_counter() - start
    return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else math.inf, "eval_s": eval_s}, eval_s


def open_loggers(cfg: Config, info: DistInfo, start_step: int) -> tuple[Path | None, Loggers | None]:
    """Rank 0's run directory and loggers (None elsewhere). Collective over the world: a logger
    that cannot start stops every rank at start-up with its one line."""
    error = None
    out: tuple[Path | None, Loggers | None] = (None, None)
    if info.rank == 0:
        try:
            run_dir = run_path(cfg.run)
            metrics = create_run_dir(run_dir, dump_yaml(cfg), start_step)
            out = run_dir, build_loggers(run_dir, metrics, start_step, run=cfg.run, config_record=to_dict(cfg))
        except MshpcError as exc:
            error = exc
    comm.raise_if_any_failed(error, "starting the loggers")
    return out


def run_training(cfg: Config, info: DistInfo, rt: Runtime, watcher: PreemptionWatcher,
                 faults: FaultHooks = NO_FAULTS, beat: Heartbeat | None = None) -> list[float]:
    """The loop itself; returns the global mean loss of every step this process trained."""
    p = cfg.parallel
    mesh = build_mesh(MeshShape(pp=p.pp, dp=p.dp, tp=p.tp, ep=p.ep))  # every group, once
    engine, step_fn = build_model_step(cfg, mesh, rt)
    load = ExpertLoad(engine.model, cfg.model.moe, cfg.model.n_layer) if cfg.model.moe else None
    optimizer = engine.optimizer  # over this rank's fp32 shard
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    # Per-rank dropout masks, as DP needs; tp ranks drop out of different tokens (sequence
    # parallelism) or heads, so theirs differ too.
    torch.manual_seed(cfg.train.seed + info.rank)
    run_dir = run_path(cfg.run)
    ckpt = TrainCheckpointer(checkpoint_root(cfg.checkpoint, run_dir), info.rank, engine, scheduler, run_dir=run_dir,
                             config_hash=config_hash(cfg), checkpoint=cfg.checkpoint, parallel=cfg.parallel,
                             train=cfg.train, data=cfg.data, model_cfg=cfg.model, before_commit=faults.before_commit)
    start_step = ckpt.resume()
    faults.install_slowdown(engine.model, start_step, cfg.train.grad_accum)
    loader = build_data(cfg, info, mesh, rt, start_step)
    evaluator = build_eval(cfg, info, mesh, rt, engine)
    log_dir, loggers = open_loggers(cfg, info, start_step)
    diag = build_collector(run_dir, info.rank, info.node, rt.device, start_step, rt.peak_tflops,
                           diagnose=cfg.diagnose, model_cfg=cfg.model, parallel=cfg.parallel)
    progress = Progress(cfg.train.steps, cfg.run.progress if info.rank == 0 else "none")
    tokens_per_step = cfg.global_batch * cfg.model.seq_len
    losses: list[float] = []
    beat = beat or open_heartbeat(cfg, None, info)
    try:
        for step in range(start_step, cfg.train.steps):
            start, wait_before = time.perf_counter(), loader.wait_s
            diag.begin_step(step + 1)
            beat.phase("data", step)
            with phase("data"):
                batch = next(loader)
            # the first step compiles (train.compile): a long phase for hang detection, like a save
            beat.phase("compile" if cfg.train.compile and step == start_step else "step", step)
            faults.at_step(step)
            loss, grad_norm = step_fn(batch)
            moe_metrics = moe_row(load, cfg.model)  # before the next step: the router biases move
            compile_row = compile_report(cfg.train, step == start_step, info.rank)
            stage1_wait_s = ckpt.pop_stage1_wait()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            losses.append(loss.item())
            # the loss is all-reduced: every rank raises alike, before a NaN can be saved
            check_loss(losses[-1], step, cfg.supervisor.loss_limit)
            # after the loss check (a diverged model is not scored); the step's row carries it
            val_row, eval_s = run_eval(evaluator, step, beat)
            beat.phase("checkpoint", step)
            with phase("checkpoint"):  # stage 1 overlaps the next forward and backward, stage 2 the next steps
                blocking_s = ckpt.maybe_save(step + 1)
            step_time_s = time.perf_counter() - start - eval_s  # the training step's own
            tokens_per_s = tokens_per_step / step_time_s
            step_mfu = mfu(tokens_per_s, cfg.model, info.world_size, rt.peak_tflops)
            tflops = diag.end_step(step + 1, tokens_per_s)
            if loggers is not None and ((step + 1) % cfg.run.log_interval_steps == 0 or val_row or compile_row):
                loggers.write({
                    "step": step + 1, "loss": losses[-1], "lr": lr, "grad_norm": grad_norm.item(),
                    "tokens_per_s": tokens_per_s, "step_time_s": step_time_s, "mfu": step_mfu, "tflops": tflops,
                    "data_wait_s": loader.wait_s - wait_before, "ckpt_blocking_s": blocking_s,
                    "ckpt_stage1_wait_s": stage1_wait_s,
                    "max_memory_gib": max_memory_gib(rt), **val_row, **compile_row, **moe_metrics,
                })
            progress.update(step, losses[-1], tokens_per_s, step_mfu)
            stop = watcher.should_stop()  # collective over the world: all ranks agree
            if stop is not None:
                if blocking_s is None:
                    ckpt.save(step + 1)
                ckpt.close()
                watcher.stop(stop, info.rank)  # rank 0 requeues if asked; raises JobStopped
        ckpt.close()
        diag.close(final_step=cfg.train.steps)  # the last straggler look sees every rank's last step
    except BaseException:
        settle_save_in_flight(ckpt, beat)
        raise
    finally:
        diag.close()
        loader.close()
        if evaluator is not None:
            evaluator.close()
        if loggers is not None:
            loggers.close()
    if log_dir is not None:
        log.info("run directory: %s", log_dir)
    return losses


def settle_save_in_flight(ckpt: TrainCheckpointer, beat: Heartbeat) -> None:
    """Before a failing rank leaves: its background save runs collectives, and exiting under
    them crashed the rank (SIGSEGV), which the supervisor reported in place of the error. The
    wait is the save's phase, with the save's timeout: a long save is no hang."""
    step = ckpt.in_flight_step
    if step is not None:
        beat.phase("checkpoint", step - 1)  # the phase of the step that saved (0-based)
        ckpt.close_after_error()


def open_heartbeat(cfg: Config, link: SupervisorLink | None, info: DistInfo) -> Heartbeat:
    """This rank's heartbeat (to the supervisor at `link`; silent without one)."""
    return start_heartbeat(link, info.rank, info.node, parallel=cfg.parallel, supervisor=cfg.supervisor,
                           saves=SaveSchedule.of(checkpoint=cfg.checkpoint, train=cfg.train))


@contextmanager
def claim_run_dir(run_dir: Path, info: DistInfo, rt: Runtime) -> Iterator[None]:
    """Make sure this rank's run holds run_dir before anything is written there. Ranks started by
    a holder (the supervisor) inherit its token and check it against the lock file; without one
    (a single process, or ranks of srun, mpiexec or torchrun alone) rank 0 takes the lock for the
    run, and the world agrees on it collectively, so every rank fails alike if it cannot."""
    token = inherited_token()
    if token is not None:
        check_run_lock(run_dir, token)
        yield
        return
    with ExitStack() as held:
        error = None
        if info.rank == 0:
            try:
                token = held.enter_context(hold_run_lock(run_dir)).token
            except RunLockError as exc:
                error = exc
        comm.raise_if_any_failed(error, "taking the run directory's lock")
        _check_rank0_holds(run_dir, token, rt)
        yield


def _check_rank0_holds(run_dir: Path, token: str | None, rt: Runtime) -> None:
    """Collective over the world: rank 0's token, as a digest summed with the others' zeros (one
    all-reduce on any backend), must be the one the lock file names on every rank."""
    digest = torch.tensor([token_digest(token) if token else 0], dtype=torch.int64, device=rt.device)
    comm.all_reduce(digest)
    holder = read_holder(run_dir / LOCK_FILE)
    if holder is None or token_digest(holder.token) != digest.item():
        who = holder.describe() if holder else "nobody"
        raise RunLockError(f"{run_dir}: rank 0 took {run_dir / LOCK_FILE}, "
                           f"but this rank sees it held by {who}")


def train(cfg: Config, env: LaunchEnv) -> list[float]:
    """Entry point for one rank: bootstrap, fit the config to the world, train, shut down."""
    run_dir = run_path(cfg.run)
    checkpoints = checkpoint_root(cfg.checkpoint, run_dir)
    # first: a signal during start-up must not kill the rank
    watcher = watch_signals(env, slurm=cfg.slurm, run_dir=run_dir, checkpoints=checkpoints)
    try:
        info = init_distributed(env)
        cfg = fit_to_world(cfg, info)
        faults = build_fault_hooks(env, info, run_dir, checkpoints)
        with open_heartbeat(cfg, env.supervisor, info) as beat:
            rt = build_runtime(cfg.train, info)
            select_cpu_tunings(rt.device)  # before the model: its optimizer and collectives follow it
            with claim_run_dir(run_dir, info, rt):  # before anything is written there
                if info.rank == 0:
                    warn_if_unfit(cfg, rt)
                return run_training(cfg, info, rt, watcher, faults, beat)
    finally:
        watcher.close()
        shutdown_distributed()
