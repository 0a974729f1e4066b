"""Validation loss on the held-out split (issue #23; torchtitan's Validator).

Every `eval.interval_steps`, all ranks score the same fixed windows: the split's first
`eval.batches` x global_batch windows, in order, each dp rank its contiguous share of each batch
(the sampler's layout), through the model as training runs it (tp/sp layers, pipeline stages),
with no gradient and no dropout. The result is a pure function of the weights and the split, so
it is reproducible and equal at every layout within fp rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mshpc.batch import Batch
from mshpc.config import DataConfig, EvalConfig, ModelConfig, ParallelConfig, TrainConfig, global_batch
from mshpc.data.blend import BlendSampler
from mshpc.data.sampler import SequenceSampler
from mshpc.data.shards import TokenDataset
from mshpc.data.sources import DataSources
from mshpc.data.window_reader import WindowReader, WindowSampler
from mshpc.model.gpt import loss_fn
from mshpc.parallel import comm
from mshpc.parallel.apply import LossFn
from mshpc.parallel.mesh import Mesh
from mshpc.parallel.pipeline import build_links, pipe_shape, stage_chunks
from mshpc.parallel.schedules import Action, PipeShape, link
from mshpc.parallel.tensor import vocab_parallel_cross_entropy
from mshpc.parallel.tp_split import chunk_bounds
from mshpc.parallel.zero import ZeroEngine

ScoreFn = Callable[[list[Batch]], torch.Tensor]  # micro-batches -> sum of their mean losses (0 off the last stage)


def split_loss(vocab_size: int, mesh: Mesh) -> LossFn:
    """The loss of the split model's logits: vocab-parallel under tp, the rank's vocabulary rows
    cut as apply_tp cuts the embedding (chunk_bounds of vocab_size)."""
    if mesh.shape.tp == 1:
        return loss_fn
    start = chunk_bounds(vocab_size, mesh.shape.tp)[mesh.coords.tp][0]
    return functools.partial(vocab_parallel_cross_entropy, vocab_start=start, group=mesh.tp)


@dataclass(frozen=True)
class Autocast:
    device_type: str
    dtype: torch.dtype | None  # None: plain fp32

    def __call__(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)


def whole_model_score(model: nn.Module, loss: LossFn, autocast: Autocast) -> ScoreFn:
    """Score micro-batches on a model that holds every layer (pp = 1)."""
    def score(micros: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=micros[0].tokens.device)
        for micro in micros:
            with autocast():
                total += loss(model(micro.inputs, micro.segments), micro.targets).float()
        return total
    return score


@dataclass(frozen=True)
class PipeForward:
    """Forward-only pipeline: each micro-batch goes through the stages one after another (no
    schedule: a rare pass with nothing to overlap it with). Collective over the pp group."""

    chunks: list[nn.Module]
    shape: PipeShape
    pp_rank: int
    ranks: tuple[int, ...]
    groups: dict
    act_shape: tuple[int, ...]
    act_dtype: torch.dtype
    loss: LossFn
    autocast: Autocast

    def __call__(self, micros: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=micros[0].tokens.device)
        for m, micro in enumerate(micros):
            for stage in range(self.pp_rank, self.shape.stages, self.shape.pp):
                total += self._stage(m, stage, micro)
        return total

    def _stage(self, m: int, stage: int, micro: Batch) -> torch.Tensor:
        x = micro.inputs
        if stage > 0:
            name, peer = link(Action("recv_act", m, stage), self.shape.pp)
            x = torch.empty(self.act_shape, dtype=self.act_dtype, device=x.device)
            comm.irecv(x, self.ranks[peer], self.groups[name]).wait()
        with self.autocast():
            out = self.chunks[stage // self.shape.pp](x, micro.segments)
            if stage == self.shape.stages - 1:
                return self.loss(out, micro.targets).float()
        name, peer = link(Action("send_act", m, stage), self.shape.pp)
        # every rank walks the same (micro, stage) order, so each send's receive is next in line
        comm.isend(out.to(self.act_dtype).contiguous(), self.ranks[peer], self.groups[name]).wait()
        return torch.zeros((), device=x.device)


class Evaluator:
    """Built by `build_evaluator`; `evaluate()` is collective over the world."""

    def __init__(self, reader: WindowReader, dp_rank: int, engine: ZeroEngine, score: ScoreFn,
                 device: torch.device, *, eval_cfg: EvalConfig, parallel: ParallelConfig, train: TrainConfig,
                 batches: int, warning: str | None = None) -> None:
        self.reader, self.dp_rank = reader, dp_rank
        self.engine, self.score, self.device = engine, score, device
        # batches: eval.batches, or fewer where the split holds fewer (eval_batches); warning: why, for rank 0
        self.interval_steps, self.batches, self.micro_batch = eval_cfg.interval_steps, batches, train.micro_batch
        self.warning = warning
        # pp: only last stages hold a loss, so over the world; else every rank of a dp group
        # has the same tp-reduced loss, so over the dp group
        self._group = None if parallel.pp > 1 else engine.group
        micros = train.grad_accum  # micro-batches per dp rank and batch
        # losses summed over: batches x micro-batches x dp ranks (x tp ranks on the last pp
        # stage, where the world all-reduce adds each tp rank's copy of the loss)
        self._terms = batches * micros * parallel.dp * (parallel.tp if parallel.pp > 1 else 1)

    def due(self, steps_done: int) -> bool:
        """After the step that made it `steps_done` steps: every eval.interval_steps-th."""
        return self.interval_steps > 0 and steps_done % self.interval_steps == 0

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean validation loss over the fixed windows, the same on every rank."""
        self.engine.wait_params()  # the last step's all-gathers, which forward hooks would wait for
        model = self.engine.model
        was_training = model.training
        model.eval()  # no dropout
        try:
            total = torch.zeros((), device=self.device)
            for b in range(self.batches):
                batch = self.reader.batch(b, self.dp_rank).to(self.device)
                total += self.score(batch.split(self.micro_batch))
        finally:
            model.train(was_training)
        comm.all_reduce(total, group=self._group)
        return total.item() / self._terms

    def close(self) -> None:
        self.reader.close()


def held_out_windows(sampler: WindowSampler) -> int:
    """The windows of the held-out split (a blend's: every source's)."""
    if isinstance(sampler, BlendSampler):
        return sum(s.n_windows for s in sampler.samplers)
    assert isinstance(sampler, SequenceSampler), sampler  # DataSources.sampler makes one of the two
    return sampler.n_windows


def eval_batches(n_windows: int, global_batch: int, wanted: int, seq_len: int) -> tuple[int, str | None]:
    """How many global batches an evaluation scores so that no window counts twice: eval.batches,
    or as many whole batches as the split holds; and the line that says why, when fewer (one
    batch, some windows in it twice, when the split is smaller than one batch)."""
    whole = n_windows // global_batch
    if whole >= wanted:
        return wanted, None
    held = (f"the held-out split has {n_windows} windows of {seq_len + 1} tokens, fewer than eval.batches x "
            f"the global batch = {wanted} x {global_batch}")
    if whole == 0:
        return 1, (f"validation: {held}: each evaluation scores 1 batch of {global_batch} windows, only "
                   f"{n_windows} of them distinct (the rest repeats); hold out more text (mshpc prepare "
                   "--val-fraction, --val)")
    return whole, (f"validation: {held}: each evaluation scores {whole} batch{'es' if whole > 1 else ''} "
                   f"({whole * global_batch} windows, none twice) instead of {wanted}")


def build_evaluator(mesh: Mesh, engine: ZeroEngine, val: TokenDataset | DataSources, device: torch.device,
                    autocast: torch.dtype | None, *, eval_cfg: EvalConfig, model_cfg: ModelConfig,
                    parallel: ParallelConfig, train: TrainConfig, data: DataConfig) -> Evaluator:
    """This rank's evaluator over the held-out dataset `val`. Collective over the pp group
    (its links) when pp > 1."""
    sources = val if isinstance(val, DataSources) else DataSources.single(val)
    sampler = sources.sampler(model_cfg.seq_len, global_batch(train, parallel), data.seed, shuffle=False)
    reader = sources.reader(sampler, parallel.dp, data.doc_mask)
    cast = Autocast(device.type, autocast)
    loss = split_loss(model_cfg.vocab_size, mesh)
    score: ScoreFn
    if parallel.pp == 1:
        score = whole_model_score(engine.model, loss, cast)
    else:
        shape = pipe_shape(parallel, train)
        links = build_links(mesh, parallel.virtual_stages)  # its own: never queued behind training's
        act_shape = (train.micro_batch, model_cfg.seq_len // parallel.tp, model_cfg.d_model)
        dtype = next(engine.model.parameters()).dtype
        chunks: list[nn.Module] = list(stage_chunks(engine.model, shape, mesh.coords.pp))  # type: ignore[arg-type]
        score = PipeForward(chunks, shape, mesh.coords.pp, links.ranks, links.groups, act_shape, dtype, loss, cast)
    batches, warning = eval_batches(held_out_windows(sampler), global_batch(train, parallel), eval_cfg.batches,
                                    model_cfg.seq_len)
    return Evaluator(reader, mesh.coords.dp, engine, score, device, eval_cfg=eval_cfg, parallel=parallel, train=train,
                     batches=batches, warning=warning)
