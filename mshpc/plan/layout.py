"""The layouts the planner weighs: every (dp, tp, pp, virtual stages, micro-batch, activation
checkpointing, ZeRO stage, and for a mixture of experts ep) that the engine accepts for a model,
a GPU count and a global batch.

The global batch (sequences per optimizer step) stays fixed across layouts, as Megatron-LM's
`--global-batch-size` does: it is the config's train.micro_batch * train.grad_accum *
parallel.dp, and each layout splits it into dp * micro_batch * n_micro.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mshpc.config import ModelConfig, ParallelConfig, TrainConfig
from mshpc.errors import ConfigError

Checkpointing = Literal["none", "selective", "full"]
CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "selective", "full")
ZeroStage = Literal[2, 3]
ZERO_STAGES: tuple[ZeroStage, ...] = (2, 3)
MICRO_BATCHES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    virtual_stages: int
    micro_batch: int
    n_micro: int  # micro-batches per step per pipeline (train.grad_accum)
    checkpointing: Checkpointing
    ep: int = 1  # expert parallelism, carved out of dp (a mixture of experts only)
    zero_stage: ZeroStage = 2  # parallel.zero_stage: 3 shards the weights too

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _virtual_stages(n_layer: int, pp: int, n_micro: int) -> list[int]:
    """1, and for pp > 1 every v that splits the layers evenly and that the interleaved
    schedule accepts (micro-batches a multiple of pp, Narayanan et al. 2021 sec. 2.2)."""
    if pp == 1 or n_micro % pp:
        return [1]
    return [v for v in _divisors(n_layer // pp)]


def expert_parallel_sizes(m: ModelConfig, dp: int) -> list[int]:
    """The ep a layout of `dp` may take: 1 for a dense model, else every divisor of dp that
    divides the experts (Megatron-Core's rule, ep carved out of dp)."""
    if m.moe is None:
        return [1]
    return [e for e in _divisors(dp) if m.moe.n_experts % e == 0]


def enumerate_layouts(gpus: int, gpus_per_node: int, *, model_cfg: ModelConfig, global_batch: int) -> list[Layout]:
    """Every valid layout of `gpus` GPUs: tp divides n_head and stays within a node (its
    collectives need NVLink), pp * v divides n_layer, dp * micro_batch divides the global batch;
    a mixture of experts also every ep of `expert_parallel_sizes`."""
    if gpus < 1 or gpus_per_node < 1:
        raise ConfigError(f"--gpus={gpus} and --gpus-per-node={gpus_per_node} must be >= 1")
    m, batch = model_cfg, global_batch
    layouts = []
    for tp in (t for t in _divisors(m.n_head) if t <= gpus_per_node and gpus % t == 0):
        for pp in (p for p in _divisors(m.n_layer) if (gpus // tp) % p == 0):
            dp = gpus // (tp * pp)
            for mb in (b for b in MICRO_BATCHES if batch % (dp * b) == 0):
                n_micro = batch // (dp * mb)
                for v in _virtual_stages(m.n_layer, pp, n_micro):
                    layouts += [Layout(dp, tp, pp, v, mb, n_micro, ac, ep, zero) for ac in CHECKPOINTING
                                for ep in expert_parallel_sizes(m, dp) for zero in ZERO_STAGES]
    if not layouts:
        raise ConfigError(
            f"no layout of {gpus} GPUs divides the global batch of {batch} sequences "
            f"(train.micro_batch*train.grad_accum*parallel.dp); choose a batch that dp can divide"
        )
    return layouts


def layout_of(parallel: ParallelConfig, train: TrainConfig) -> Layout:
    """The layout a config trains with as written."""
    p, t = parallel, train
    return Layout(p.dp, p.tp, p.pp, p.virtual_stages, t.micro_batch, t.grad_accum, p.activation_checkpointing, p.ep,
                  p.zero_stage)
