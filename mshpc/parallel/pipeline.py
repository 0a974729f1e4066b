"""Pipeline parallelism: the GPT cut into stages, and a pipeline rank's train step, which runs its
schedule's plan (`schedules.py`) with asynchronous point-to-point sends and receives.

Narayanan et al. 2021 (sec. 2.2) for the schedules and virtual stages, MegaScale (Jiang et al.
2024, sec. 3.2) for decoupled send/recv, torchtitan for the split: build the whole model, keep
what a stage owns, so every parameter keeps its full-model name (and a checkpoint's tensors are
globally unique). The rank's parts form one model for ZeRO, the optimizer and checkpoints; its
chunks (one per virtual stage) share those modules and are what the schedule runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from mshpc.batch import Batch
from mshpc.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from mshpc.diagnose.timers import phase
from mshpc.model.gpt import GPT
from mshpc.parallel import comm
from mshpc.parallel.apply import LossFn, parallelize
from mshpc.parallel.mesh import Mesh
from mshpc.parallel.schedules import LINKS, Action, Op, PipeShape, build_plan, link
from mshpc.parallel.update import clipped_update
from mshpc.parallel.zero import ZeroEngine
from mshpc.phases import BACKWARD, FORWARD

TIED = ("tok_embeddings.weight", "lm_head.weight")  # the first stage's and the last stage's names


def pipe_shape(parallel: ParallelConfig, train: TrainConfig) -> PipeShape:
    """Micro-batches per step are train.grad_accum (Megatron's num_microbatches)."""
    return PipeShape(parallel.pp, parallel.virtual_stages, train.grad_accum)


# ---------------------------------------------------------------- the split


def _part(model: GPT, layers: list[int], embed: bool, head: bool) -> GPT:
    """A GPT over some of `model`'s modules (shared, not copied), the rest None: GPT.forward
    then runs just those. Registered in GPT's own order, so backward order is bucket order."""
    part = GPT.__new__(GPT)
    nn.Module.__init__(part)
    part.cfg = model.cfg
    part.tok_embeddings = model.tok_embeddings if embed else None
    part.dropout = model.dropout
    part.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    part.norm = model.norm if head else None
    part.lm_head = model.lm_head if head else None
    return part


def stage_layers(cfg: ModelConfig, shape: PipeShape, stage: int) -> list[int]:
    """The layers of virtual stage `stage`: an even, contiguous share (config.py checks that
    pp * virtual_stages divides n_layer)."""
    per = cfg.n_layer // shape.stages
    return list(range(stage * per, (stage + 1) * per))


def _stages(shape: PipeShape, rank: int) -> list[int]:
    """Pp rank `rank`'s virtual stages, by chunk: stage g = chunk * pp + rank (Megatron's
    interleaved assignment)."""
    return [c * shape.pp + rank for c in range(shape.virtual_stages)]


def stage_model(model: GPT, shape: PipeShape, rank: int) -> GPT:
    """Pp rank `rank`'s share of the whole `model`: every part its stages own, in one model
    (what the parallelisms are applied to and ZeRO, the optimizer and checkpoints see)."""
    owned = [i for g in _stages(shape, rank) for i in stage_layers(model.cfg, shape, g)]
    return _part(model, owned, rank == 0, rank == shape.pp - 1)


def stage_chunks(model: GPT, shape: PipeShape, rank: int) -> list[GPT]:
    """The chunks of a rank's stage model, one per virtual stage, sharing its modules: made after
    the parallelisms have replaced any, so the chunks run the final ones."""
    return [_part(model, stage_layers(model.cfg, shape, g), g == 0, g == shape.stages - 1)
            for g in _stages(shape, rank)]


def tied_weights(cfg: ModelConfig, shape: PipeShape, rank: int) -> frozenset[str]:
    """The name of this rank's copy of the tied embedding (first stage: the embedding, last stage:
    the head), or nothing."""
    if not cfg.tie_embeddings or 0 < rank < shape.pp - 1:
        return frozenset()
    return frozenset([TIED[0] if rank == 0 else TIED[1]])


# ---------------------------------------------------------------- running a plan


@dataclass(frozen=True)
class PipeLinks:
    """The pp group's global ranks (by pp rank) and one process group per link over them: a
    link's traffic goes one way, so on NCCL, where a pair's sends and receives queue on one
    stream per communicator, an early receive never blocks a send behind it."""

    ranks: tuple[int, ...]
    groups: dict[str, dist.ProcessGroup]


@dataclass
class _StepState:
    """What one step holds between actions, by (micro-batch, stage) or by action."""

    micros: list[Batch]  # each: tokens (b, s + 1), segments (b, s) or None
    loss_sum: torch.Tensor
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    pending: dict[Action, tuple[comm.Pending, torch.Tensor]] = field(default_factory=dict)  # in flight, with its buffer


class PipelineRunner:
    """Runs one rank's plan per step. Collective over the pp group (point-to-point) and, through
    the engine's backward, over the dp group."""

    def __init__(self, chunks: list[GPT], plan: list[Action], shape: PipeShape, links: PipeLinks,
                 engine: ZeroEngine, loss_fn: LossFn, act_shape: tuple[int, ...], act_dtype: torch.dtype,
                 autocast: torch.dtype | None) -> None:
        self.chunks, self.plan, self.shape, self.links = chunks, plan, shape, links
        self.engine, self.loss_fn = engine, loss_fn
        self.act_shape, self.act_dtype, self.autocast = act_shape, act_dtype, autocast
        backwards = [a for a in plan if a.op == "backward"]
        self.last_backward = {a.stage: a for a in backwards}  # each chunk's: its buckets sync there
        self.final = backwards[-1]  # the step's: the engine launches what is left there
        self.wait_s = 0.0  # time blocked on receives and sends, summed over steps
        self.run_s = 0.0  # time in run(), summed over steps
        self.peak_live = 0  # the most micro-batch activations (stage inputs and graphs) held at once

    def run(self, micros: list[Batch]) -> torch.Tensor:
        """Forward and backward of every micro-batch on this rank's stages; returns the sum of
        the micro-batch losses / m on the last stage, 0 elsewhere."""
        start = time.perf_counter()
        state = _StepState(micros, torch.zeros((), device=micros[0].tokens.device))
        for a in self.plan:
            kind = a.op.split("_")[0]  # recv, send, wait, forward, backward
            getattr(self, f"_{kind}")(a, state)
        assert not (state.pending or state.outputs or state.inputs), "the plan left work behind"
        self.run_s += time.perf_counter() - start
        return state.loss_sum

    def _recv(self, a: Action, state: _StepState) -> None:
        name, peer = link(a, self.shape.pp)
        buffer = torch.empty(self.act_shape, dtype=self.act_dtype, device=state.loss_sum.device)
        state.pending[a] = (comm.irecv(buffer, self.links.ranks[peer], self.links.groups[name]), buffer)

    def _send(self, a: Action, state: _StepState) -> None:
        name, peer = link(a, self.shape.pp)
        key = (a.micro, a.stage)
        tensor = (state.outputs[key] if a.op == "send_act" else state.input_grads.pop(key)).detach()
        assert tensor.shape == self.act_shape and tensor.dtype == self.act_dtype, (a, tensor.shape, tensor.dtype)
        state.pending[a] = (comm.isend(tensor, self.links.ranks[peer], self.links.groups[name]), tensor)

    def _wait(self, a: Action, state: _StepState) -> None:
        done = cast(Op, a.op.removeprefix("wait_"))  # wait_<op> waits for <op>, itself an Op
        self._landed(Action(done, a.micro, a.stage), state)

    def _landed(self, a: Action, state: _StepState) -> torch.Tensor:
        """Wait for communication `a`; its buffer is then free (a send's) or full (a receive's)."""
        start = time.perf_counter()
        work, tensor = state.pending.pop(a)
        work.wait()
        self.wait_s += time.perf_counter() - start
        return tensor

    def _forward(self, a: Action, state: _StepState) -> None:
        micro = state.micros[a.micro]
        if a.stage == 0:
            x = micro.inputs
        else:
            x = self._landed(Action("recv_act", a.micro, a.stage), state).requires_grad_()
        with phase(FORWARD), torch.autocast(x.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            out = self.chunks[a.stage // self.shape.pp](x, micro.segments)
            if a.stage == self.shape.stages - 1:
                out = self.loss_fn(out, micro.targets) / self.shape.micro_batches
                state.loss_sum += out.detach()
        state.inputs[a.micro, a.stage], state.outputs[a.micro, a.stage] = x, out
        self.peak_live = max(self.peak_live, len(state.inputs))

    def _backward(self, a: Action, state: _StepState) -> None:
        grad = None
        if a.stage < self.shape.stages - 1:
            grad = self._landed(Action("recv_grad", a.micro, a.stage), state)
        out = state.outputs.pop((a.micro, a.stage))  # a send still in flight holds its own reference
        with phase(BACKWARD):
            self.engine.backward(out, sync=self.last_backward[a.stage] == a, grad=grad, flush=a == self.final)
        x = state.inputs.pop((a.micro, a.stage))
        if a.stage > 0:
            assert x.grad is not None  # x was received with requires_grad_(), and backward ran
            state.input_grads[a.micro, a.stage] = x.grad


# ---------------------------------------------------------------- building and stepping


def build_links(mesh: Mesh, virtual_stages: int) -> PipeLinks:
    """One process group per link over this rank's pp group, members only like the mesh's
    (every rank creates the same ones, in the same order). Collective over the pp group."""
    ranks = mesh.shape.group_ranks(mesh.rank)["pp"]
    names = LINKS if virtual_stages > 1 else ("act", "grad")  # only interleaving wraps around
    groups = {name: dist.new_group(list(ranks), use_local_synchronization=True, group_desc=f"pp_{name}")
              for name in names}
    links = PipeLinks(ranks, groups)
    connect_links(links, mesh.coords.pp)
    return links


def link_edges(name: str, pp: int) -> list[tuple[int, int]]:
    """The pp-rank pairs (lower first) that link `name` joins: neighbours, or the wrap-around."""
    if name.endswith("_wrap"):
        return [(0, pp - 1)] if pp > 1 else []
    return [(i, i + 1) for i in range(pp - 1)]


def connect_links(links: PipeLinks, pp_rank: int) -> None:
    """Connect every pair of every link before a schedule runs. A lazily connected pair (gloo under
    launch.rendezvous.connect_lazily; NCCL's per-pair communicators) connects inside the first
    send or receive posted on it, and that call blocks until the peer posts on the same pair of
    the same group. The schedules post receives early and on several links, so rank 0 posting
    its first grad receive while rank 1 waits for its first activation deadlocked (1 run in 2 at
    pp=2, as the pairs' addresses fell). Here each rank takes its pairs in one order the whole
    pp group shares (link, then lower rank), so the lowest pair not yet connected always has both
    ends at it. Collective over the pp group."""
    pp = len(links.ranks)
    on_gpu = any(dist.get_backend(g) == "nccl" for g in links.groups.values())
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    for name, group in links.groups.items():
        for lo, hi in link_edges(name, pp):
            if pp_rank in (lo, hi):
                peer = links.ranks[hi if pp_rank == lo else lo]
                out, back = torch.zeros(1, device=device), torch.empty(1, device=device)
                works = [comm.isend(out, peer, group), comm.irecv(back, peer, group)]
                for work in works:
                    work.wait()


@dataclass(frozen=True)
class Pipeline:
    """A pipeline rank's model (every part it owns), its ZeRO engine and its plan's runner."""

    model: GPT
    engine: ZeroEngine
    runner: PipelineRunner


def build_pipeline(mesh: Mesh, device: torch.device, autocast: torch.dtype | None, whole: GPT | None = None, *,
                   model_cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                   optim: OptimConfig) -> Pipeline:
    """Split the whole GPT (`whole`, or one drawn here; seeded by the caller: every rank draws the
    same weights), keep this rank's stages and apply the other parallelisms to them
    (apply.parallelize: TP/SP, recompute, ZeRO). Collective over the mesh."""
    shape, rank = pipe_shape(parallel, train), mesh.coords.pp
    model = stage_model(whole if whole is not None else GPT(model_cfg), shape, rank).to(device)
    split = parallelize(model, mesh, model_cfg=model_cfg, parallel=parallel, train=train, optim=optim,
                        tied=tied_weights(model_cfg, shape, rank))
    plan = build_plan(parallel.pp_schedule, shape, rank)
    # between stages the residual stream, (b, s / tp, d) under sequence parallelism
    act_shape = (train.micro_batch, model_cfg.seq_len // parallel.tp, model_cfg.d_model)
    dtype = next(model.parameters()).dtype  # the residual stream's: fp32 under bf16 autocast too
    runner = PipelineRunner(stage_chunks(model, shape, rank), plan, shape, build_links(mesh, parallel.virtual_stages),
                            split.engine, split.loss_fn, act_shape, dtype, autocast)
    return Pipeline(model, split.engine, runner)


def pipeline_train_step(pipe: Pipeline, batch: Batch, *, train: TrainConfig, optim: OptimConfig,
                        parallel: ParallelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """train.train_step for a pipeline rank: one optimizer step over the rank's batch (grad_accum
    micro-batches). Collective over the world. Returns the loss averaged over the global batch
    (on every rank) and the global grad norm before clipping."""
    micros = batch.split(train.micro_batch)  # tokens (micro_batch, seq_len + 1) each
    loss_sum = pipe.runner.run(micros)
    # Only the last stage has a loss, one copy per dp and tp rank there; a world all-reduce of a
    # scalar reports it everywhere.
    return clipped_update(pipe.engine, loss_sum, grad_clip=optim.grad_clip, loss_group=None,
                          loss_terms=parallel.dp * parallel.tp)
