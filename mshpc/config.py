"""The config tree: frozen dataclasses, strict YAML loading, dotted overrides, validation.

Every component receives its own section(s) as keyword arguments, never the whole `Config`
(tests/unit/test_config_sections.py); only the entry points (train.py, cli.py) hold it whole. Unknown keys, wrong types and impossible
combinations raise a one-line `ConfigError` naming the key and the valid choices.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mshpc.errors import ConfigError, shown


def at_least(bound: float, *, default: Any) -> Any:
    """A field whose value must be >= `bound` (checked by `validate`); `default` is its value
    when the YAML leaves it out."""
    return field(default=default, metadata={"min": bound})


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts in place of the MLP of some layers (mshpc/model/moe.py; docs/moe.md)."""

    n_experts: int = at_least(1, default=8)
    top_k: int = at_least(1, default=2)  # routed experts per token
    expert_ffn_dim: int | None = at_least(1, default=None)  # each expert's SwiGLU width; None: model.ffn_width
    # always-on experts beside the routed ones (DeepSeek, Qwen2-MoE): one SwiGLU MLP of
    # n_shared_experts * expert_ffn_dim; shared_expert_gate scales it by sigmoid(x w) (Qwen2-MoE)
    n_shared_experts: int = at_least(0, default=0)
    shared_expert_gate: bool = False
    # softmax_topk: softmax over the experts, the top k (Mixtral, Qwen); sigmoid_bias: sigmoid
    # scores, the top k of score + a per-expert bias that each step nudges toward balance by
    # bias_update_rate (DeepSeek-V3 sec. 2.1.2, no auxiliary loss needed)
    router: Literal["softmax_topk", "sigmoid_bias"] = "softmax_topk"
    norm_topk_prob: bool = True  # the k weights renormalised to sum to 1 (Mixtral, Qwen3-MoE)
    bias_update_rate: float = at_least(0.0, default=1e-3)
    aux_loss_coef: float = at_least(0.0, default=0.01)  # Switch Transformer's load-balancing loss (Fedus et al. 2022 eq. 4)
    z_loss_coef: float = at_least(0.0, default=0.0)  # ST-MoE's router z-loss (Zoph et al. 2022 eq. 5)
    # tokens an expert takes per micro-batch: ceil(capacity_factor * tokens * top_k / n_experts),
    # the lowest-weighted beyond it dropped (Megatron's "probs" policy); null: dropless
    capacity_factor: float | None = None
    # layer i is a mixture of experts when i >= first_dense_layers and i % every == 0 (DeepSeek's rule)
    first_dense_layers: int = at_least(0, default=0)
    every: int = at_least(1, default=1)
    # how the experts' GEMMs run: grouped_mm (torch._grouped_mm, one kernel for every expert),
    # loop (one GEMM per expert), auto: grouped_mm where this torch and device have it
    experts_impl: Literal["auto", "grouped_mm", "loop"] = "auto"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = at_least(2, default=257)  # byte tokenizer: 256 bytes + end-of-document
    seq_len: int = at_least(1, default=256)
    n_layer: int = at_least(1, default=4)
    n_head: int = at_least(1, default=4)
    d_model: int = at_least(2, default=256)
    mlp_ratio: int = at_least(1, default=4)
    # layernorm + gelu (serial or parallel block) is GPT-NeoX's model, rmsnorm + swiglu Llama's
    # (`mshpc export`); the default is GPT-3's LayerNorm and GeLU
    norm: Literal["rmsnorm", "layernorm"] = "layernorm"
    norm_eps: float = 1e-5
    parallel_block: bool = False  # MegaScale/PaLM: attn and MLP from one normed input, summed
    sliding_window: int | None = None  # each token sees at most the previous W tokens
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    dropout: float = at_least(0.0, default=0.0)
    init_std: float = 0.02
    # csrc/ kernels (fused add+norm, bias+GeLU, RoPE, multi-tensor optimizer step): auto uses them
    # where they build and otherwise the pure-torch references; on fails if they cannot build
    fused_kernels: Literal["auto", "on", "off"] = "auto"
    mlp_bias: bool = False  # biases in the MLP (GPT-2's); the first is added inside the fused GeLU
    # gelu: d -> ffn -> d with GeLU (GPT-2, GPT-NeoX); swiglu: silu(x W_gate) * (x W_up) -> W_down
    # (Shazeer 2020; Llama), three matrices
    mlp: Literal["gelu", "swiglu"] = "gelu"
    ffn_dim: int | None = at_least(1, default=None)  # the MLP's hidden width; None: mlp_ratio * d_model
    # grouped-query attention (Ainslie et al. 2023): key/value heads, dividing n_head; 1 is
    # multi-query attention; None: n_head (plain multi-head attention)
    n_kv_head: int | None = at_least(1, default=None)
    # each head's width; None: d_model / n_head. Qwen3 widens it (d 2048, 32 heads of 128)
    head_dim: int | None = at_least(2, default=None)
    qk_norm: bool = False  # RMSNorm of each q and k head over head_dim before RoPE (Qwen3, OLMo 2)
    moe: MoEConfig | None = None  # a mixture of experts in some layers' place of the MLP; null: dense
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2's; none on the output projection)
    # RoPE frequency scaling for long contexts: none, or llama3 (Llama 3.1/3.2: low frequencies
    # divided by rope_factor, high ones kept, the band between blended; Meta's release, as
    # transformers computes it), for a model trained at rope_original_seq_len positions
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = at_least(1.0, default=8.0)
    rope_low_freq_factor: float = at_least(0.0, default=1.0)
    rope_high_freq_factor: float = at_least(0.0, default=4.0)
    rope_original_seq_len: int = at_least(1, default=8192)

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width: ffn_dim, or mlp_ratio * d_model when it is not set."""
        return self.ffn_dim if self.ffn_dim is not None else self.mlp_ratio * self.d_model

    @property
    def head_size(self) -> int:
        """Each attention head's width: head_dim, or d_model / n_head when it is not set."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is not set."""
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def expert_ffn(self) -> int:
        """Each routed expert's width: moe.expert_ffn_dim, or ffn_width when it is not set."""
        assert self.moe is not None, "a dense model has no experts"
        return self.moe.expert_ffn_dim if self.moe.expert_ffn_dim is not None else self.ffn_width

    @property
    def shared_ffn(self) -> int:
        """Width of the shared experts' one MLP (0: none): n_shared_experts * expert_ffn."""
        return 0 if self.moe is None else self.moe.n_shared_experts * self.expert_ffn

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer `i` has a mixture of experts in place of its MLP."""
        moe = self.moe
        return moe is not None and i >= moe.first_dense_layers and i % moe.every == 0

    @property
    def moe_layers(self) -> int:
        """How many layers are mixtures of experts: the multiples of every in [first_dense_layers, n_layer)."""
        if self.moe is None:
            return 0
        every, first = self.moe.every, min(self.moe.first_dense_layers, self.n_layer)
        return -(-self.n_layer // every) - -(-first // every)


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = at_least(1, default=1)
    tp: int = at_least(1, default=1)
    pp: int = at_least(1, default=1)
    virtual_stages: int = at_least(1, default=1)
    dp_overlap: bool = True  # reduce-scatter during backward, all-gather during the next forward
    # MiB of fp32 gradients per bucket (one reduce-scatter, one all-gather), DDP's default;
    # smaller buckets start communicating earlier in backward, at more per-collective overhead
    bucket_mb: float = 25.0
    # dp ranks of one host on CPU (gloo) keep their buckets in shared memory and read each other's
    # rows from it, instead of sending them over loopback TCP (mshpc/cpu_ranks/shared_buckets.py; CPU ranks only)
    dp_shared_memory: bool = True
    # tp > 1 runs sequence parallelism (Korthikanti et al. 2022); with overlap its all-gathers and
    # reduce-scatters go in this many chunks along the sequence, each overlapping a GEMM
    tp_overlap: bool = True
    tp_overlap_chunks: int = at_least(1, default=2)
    # the parallel block (model.parallel_block) under tp > 1 shares one all-gather between qkv and
    # mlp.fc and reduce-scatters the sum of its two outputs once; false: Megatron's 2 + 2 per layer
    tp_fused_block: bool = True
    # none | full (recompute each block) | selective (recompute the attention core)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    # pipeline schedule: 1f1b (interleaved 1F1B when virtual_stages > 1) or gpipe (all forwards,
    # then all backwards: the baseline, holding every micro-batch's activations)
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    # 2: every dp rank keeps the whole model's parameters and shards masters, optimizer state and
    # gradients (ZeRO-2); 3: parameters sharded too, each unit of blocks all-gathered just before
    # its forward and its backward, the next unit's gather overlapping this one's compute, and
    # freed after use (ZeRO-3 / FSDP; mshpc/parallel/zero3.py)
    zero_stage: Literal[2, 3] = 2
    zero3_blocks_per_unit: int = at_least(1, default=1)  # blocks gathered together at stage 3
    # stage 3: free a unit's gathered parameters after its forward and gather them again for its
    # backward (FSDP2's knob); false keeps them from forward to backward: 1.0x stage 2's traffic
    # instead of 1.5x, for the memory of every parameter at the end of forward
    reshard_after_forward: bool = True
    # manual: dp, tp, pp, virtual_stages, micro_batch, grad_accum and activation_checkpointing as
    # written (dp fitted to the world); auto: `mshpc plan`'s fastest layout that fits the world
    # the job gets, at this config's global batch (mshpc/plan/auto_layout.py)
    layout: Literal["manual", "auto"] = "manual"
    # expert parallelism (model.moe): each MoE layer's experts split over ep ranks carved out of
    # the data-parallel ones (Megatron-Core's rule), tokens sent to their experts' ranks and back
    # by all-to-all; ep divides dp and moe.n_experts (docs/moe.md)
    ep: int = at_least(1, default=1)
    # the dispatch of one chunk of a micro-batch's tokens runs while the previous chunk's experts
    # compute, and the shared experts while the first is in flight (MegaScale-MoE sec. 4)
    ep_overlap: bool = True
    ep_overlap_chunks: int = at_least(1, default=2)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "lamb"] = "adamw"
    lr: float = at_least(0.0, default=3e-4)
    min_lr: float = at_least(0.0, default=3e-5)
    warmup_steps: int = at_least(0, default=10)
    weight_decay: float = at_least(0.0, default=0.1)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = at_least(0.0, default=1.0)  # max global grad norm; 0 turns clipping off
    # after the warmup: cosine (half-cosine from lr to min_lr at train.steps), wsd
    # (warmup-stable-decay: lr held, then decayed to min_lr over the last decay_fraction of the
    # steps; Hägele et al. 2024, the schedule of most 2025 pretraining runs, which a run can be
    # continued from before its decay), or constant (lr held to the end)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = at_least(0.0, default=0.2)  # wsd: the share of train.steps spent decaying
    # wsd's decay from lr to min_lr: linear, sqrt (1 - sqrt of the progress, Hägele et al.'s
    # best) or cosine
    decay_shape: Literal["linear", "sqrt", "cosine"] = "sqrt"


@dataclass(frozen=True)
class SourceConfig:
    """One source of a blend: a dataset folder of `mshpc prepare` or a Megatron .bin/.idx prefix,
    drawn from in proportion to its weight (Megatron's --data-path weighting)."""

    path: str = ""
    weight: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    # a folder made by `mshpc prepare`, or a Megatron .bin/.idx pair (its path prefix, as Megatron's
    # --data-path names it); None: the embedded stdlib corpus (or data.sources)
    path: str | None = None
    # a blend: each source's windows drawn in proportion to its weight (normalized), a pure
    # function of (seed, step, dp rank); replaces data.path
    sources: tuple[SourceConfig, ...] = ()
    # auto: the tokenizer the dataset was prepared with (kept in it). Or a tokenizer (as for mshpc
    # prepare --tokenizer): it must be the data's, and names the one a Megatron .bin/.idx pair
    # was made with (such a pair does not record it)
    tokenizer: str = "auto"
    # of a Megatron .bin/.idx source, the last fraction of its documents is its held-out split
    # (Megatron's --split 969,30,1 is 0.031 here); mshpc datasets have their own val/ folder
    indexed_val_fraction: float = 0.0
    cache_dir: str = ".cache/mshpc"  # where the embedded corpus is prepared on first use
    seed: int = 1234
    prefetch_batches: int = at_least(1, default=4)
    loader: Literal["auto", "torch", "dali"] = "auto"  # auto: DALI where it is installed, else torch
    # one rank per node reads and prepares every local rank's batches into shared memory
    per_node_reader: bool = False
    doc_mask: bool = False  # attention stays inside each document of a packed sequence
    dali_threads: int = at_least(1, default=2)  # DALI's CPU worker threads per rank
    # each rank appends the sha256 of every step's windows to <run dir>/windows/rank-NNNNN.jsonl:
    # shows that a resumed run trained on exactly the windows an uninterrupted one did
    record_windows: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    # save every N steps, at the end of the run and when stopped (SIGTERM, SIGINT, Slurm's
    # pre-timeout signal); 0 turns saving off (a stop still saves). torchtitan's interval.
    interval_steps: int = at_least(0, default=500)
    keep: int = at_least(1, default=3)  # committed checkpoints kept; older ones go after a new commit
    dir: str | None = None  # None: <run dir>/checkpoints
    async_save: bool = True  # copy beside the next forward/backward, write in the background


@dataclass(frozen=True)
class TrainConfig:
    steps: int = at_least(1, default=100)
    micro_batch: int = at_least(1, default=8)
    grad_accum: int = at_least(1, default=1)
    seed: int = 1234
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    cpu_threads: int = at_least(0, default=0)  # torch threads per rank; 0: cores / local ranks
    peak_tflops: float | None = None  # device peak for MFU; None: from the device table
    resume: str = "auto"  # "auto": latest good checkpoint if any; "never"; or a step-* folder
    # a Hugging Face folder (Llama or GPT-NeoX, safetensors; `mshpc import` writes a config for it)
    # whose weights replace the initial draw; a checkpoint that train.resume finds still wins
    init_from: str | None = None
    # nodes of the allocation (local: slots) held back to replace an evicted one
    spare_nodes: int = at_least(0, default=0)
    # torch.compile each transformer block (after tp and recomputation, before ZeRO); the first
    # step's compile time is logged and lands in its row as compile_s. On CUDA,
    # model.fused_kernels=auto then runs the pure-torch operators, which inductor fuses faster
    compile: bool = False


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    out_dir: str = "runs"
    log_interval_steps: int = at_least(1, default=1)
    progress: Literal["auto", "bar", "lines", "none"] = "auto"  # auto: a bar on a TTY
    # where rank 0's rows (loss, lr, grad norm, tokens/s, MFU, validation, checkpoint times) and
    # events go: jsonl (metrics.jsonl, always: diagnose and resume read it), tensorboard
    # (<run dir>/tb/, pip install 'mshpc[tensorboard]'), wandb (offline without network or with
    # WANDB_MODE=offline; pip install 'mshpc[wandb]')
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)
    wandb_project: str = "mshpc"  # the W&B project runs are logged under (the run is run.name)
    # how much lower than the train loop TensorBoard and W&B run (a nice increment, capped at
    # 19, for every thread of rank 0's logger process and of W&B's service process, applied once
    # they have started): they then take a core from the ranks only when one is idle; 0 runs
    # them at the loop's priority
    logger_nice_increment: int = at_least(0, default=10)


@dataclass(frozen=True)
class EvalConfig:
    # validation loss on the held-out split (<dataset>/val: mshpc prepare --val-fraction; the
    # embedded corpus has one) after every N-th step; 0 turns it off
    interval_steps: int = at_least(0, default=0)
    # global batches per evaluation: the split's first batches x global_batch windows, in order,
    # the same ones every time (so the curve compares like with like)
    batches: int = at_least(1, default=4)


@dataclass(frozen=True)
class PlanConfig:
    # the share of each device's memory `mshpc plan` and `parallel.layout: auto` leave free: the
    # CUDA context, NCCL's buffers and the caching allocator's fragmentation, which the memory
    # model does not count (Megatron and torchtitan users keep 5-10% free in practice)
    memory_headroom: float = 0.1


@dataclass(frozen=True)
class SlurmConfig:
    # Slurm's pre-timeout signal (sbatch --signal): checkpoint, requeue, exit. Not USR1 by
    # default: NCCL may catch it.
    preempt_signal: Literal["USR2", "USR1"] = "USR2"
    # a requeue loop stops after this many consecutive failures that left no newer checkpoint
    max_failures_without_progress: int = at_least(0, default=3)


@dataclass(frozen=True)
class PreflightConfig:
    # a YAML of the shape of mshpc/preflight/thresholds.yaml, merged over the shipped limits
    thresholds: str | None = None
    burn_s: float | None = None  # sustained burn per device; None: the level's (GPU 0/30/600 s, CPU 0/2/20 s)
    pairwise_max_nodes: int = at_least(2, default=32)  # every node pair up to this many nodes; above, bisections
    bisections: int = at_least(1, default=4)  # random half/half pairings of the nodes when there are more
    timeout_s: float = at_least(1.0, default=300.0)  # a collective that takes longer fails the run, not hangs


@dataclass(frozen=True)
class DiagnoseConfig:
    timers: bool = True  # always-on phase timers -> <run dir>/timings/rank-N.jsonl
    flush_interval_s: float = at_least(0.0, default=2.0)  # how often the timings thread flushes its file
    # a rank is a straggler while the rolling median of its relative score (the median rank's
    # compute or data-wait time over its own) stays below this: 0.9 = 11% slower than the median
    straggler_threshold: float = 0.9
    straggler_window_steps: int = at_least(1, default=10)  # the rolling median's window
    straggler_history_steps: int = at_least(2, default=200)  # a rank's own history, for its individual score
    # phase times under this fraction of the median step count as this fraction (jitter in an
    # almost empty phase is not slowness)
    straggler_floor: float = at_least(0.0, default=0.05)
    straggler_check_interval_steps: int = at_least(0, default=10)  # rank 0 reads every rank's watch/ stream this often; 0: never (and no stream written)
    # ranks that share one watch/ file (rank // this; a node's GPUs, so that each file is written from
    # one node): rank 0's check reads world / this files, not one per rank
    watch_ranks_per_file: int = at_least(1, default=8)
    mfu_window_steps: int = at_least(1, default=20)  # rolling median of achieved TFLOP/s ...
    mfu_decline: float = 0.1  # ... an event when it falls this fraction below the run's best
    # Floors of what is said on the console and marked in the report (events record every flag):
    # a straggler only below this relative score (a third slower than its peers; nvidia-resiliency-
    # ext's default threshold is 0.7), an MFU decline only past this fraction. Ranks that share a host's
    # cores, two local CPU ranks say, take turns at 10-20% slower (scores 0.83-0.90 seen on a
    # loaded 2-core host) and lose 10-25% of their pace to the host's other work: that is noise,
    # not a node to evict.
    straggler_warn_below: float = 0.75
    mfu_warn_decline: float = 0.2


@dataclass(frozen=True)
class SupervisorConfig:
    """The supervisor's knobs (mshpc/launch/supervisor.py): heartbeats, timeouts, restarts."""

    heartbeat_interval_s: float = at_least(0.01, default=1.0)  # each rank's side thread reports this often
    # A rank whose beats stop this long while it lives (its connection open) is frozen: SIGSTOP, a
    # wait in the kernel, a C call that never lets go of the GIL. A hang, whatever its phase's
    # timeout; set-up and the long phases keep only theirs (a resume or save in h5py holds the
    # GIL). NVRx's in-process restart has the same rule (heartbeat_timeout). 0: off
    heartbeat_timeout_s: float = at_least(0.0, default=30.0)
    # A phase (data, step, checkpoint) hangs when it lasts longer than
    # max(floor, timeout_k x its median duration so far); before 3 samples, the floor alone.
    timeout_k: float = at_least(1.0, default=10.0)
    timeout_floor_s: float = at_least(0.1, default=60.0)
    checkpoint_timeout_s: float = at_least(0.1, default=600.0)  # the checkpoint, eval and compile phases' floor: a long save, validation or compilation is no hang
    setup_timeout_s: float = at_least(0.1, default=900.0)  # start-up: imports, rendezvous, resume
    max_restarts: int = at_least(0, default=3)  # restarts within one allocation (or local run) before giving up
    stop_grace_s: float = at_least(0.0, default=10.0)  # SIGTERM to every rank, SIGKILL after this
    evict_after: int = at_least(1, default=2)  # failures blamed on one node before it is evicted
    drain: bool = False  # admin: also `scontrol update State=DRAIN` an evicted node
    loss_limit: float | None = None  # a loss above this counts as exploding; NaN/Inf always does
    ranks_per_slot: int = at_least(1, default=1)  # local runs: ranks per simulated node ("slot")
    # Heartbeats per node (launch/node_relay.py): the ranks of a node report to one relay process over
    # a Unix socket, and one connection per node carries them all, beats batched; off: every rank
    # connects to the supervisor itself (as before issue #20; also what a rank falls back to when
    # its relay cannot be reached within 10 s)
    node_relay: bool = True


@dataclass(frozen=True)
class RecoveryConfig:
    """Recovery in place (mshpc/snapshot/, mshpc/launch/in_place.py): every step's state in host
    memory and on a buddy rank of another node; a lost or hung rank replaced inside the running
    job, the others keeping their processes; suspicious steps replayed."""

    in_place: bool = False  # recover a lost or hung rank in place; off: every failure restarts from disk
    snapshot_interval_steps: int = at_least(1, default=1)  # snapshot every N steps (when in_place or replay is on)
    replay: bool = False  # replay a step whose loss or grad norm is NaN/Inf or a spike
    spike_factor: float = at_least(1.0, default=10.0)  # a spike: past this many times the running median
    spike_window_steps: int = at_least(3, default=20)  # the running median's window
    persistent_after: int = at_least(1, default=2)  # replays a rank differs in before its node is evicted
    # in place, a disk full where the run writes its own files (metrics, timings, events) holds their
    # lines in memory this long before failing the run (mshpc/full_disk.py), and a save that must
    # succeed (the last step's, a stop's) is tried again this long (train_checkpoint.py); off: at once
    full_disk_grace_s: float = at_least(0.0, default=60.0)

    @property
    def snapshots(self) -> bool:
        return self.in_place or self.replay

    @property
    def full_disk_hold_s(self) -> float:
        """How long this process holds the run files' lines a full disk refuses (0: not at all)."""
        return self.full_disk_grace_s if self.in_place else 0.0


@dataclass(frozen=True)
class Config:
    """The whole tree, a section per part; each figure the sections give together sits after the
    last section it reads."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step across all data-parallel ranks."""
        return global_batch(self.train, self.parallel)

    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    diagnose: DiagnoseConfig = field(default_factory=DiagnoseConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)


def global_batch(train: TrainConfig, parallel: ParallelConfig) -> int:
    """Sequences per optimizer step across all data-parallel ranks."""
    return train.micro_batch * train.grad_accum * parallel.dp


# ---------------------------------------------------------------- building from plain data


@functools.cache  # evaluating the string annotations is most of a config's load time
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else tp.__name__


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; YAML 1.1 reads `3e-4` as a string, so
    floats also accept numeric strings."""
    origin = typing.get_origin(tp)
    if origin is tuple:  # tuple[X, ...]: a YAML list, each item checked as an X
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={shown(value)} must be a list (e.g. [{_describe(typing.get_args(tp)[0])}])")
        item = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item):
            return tuple(_build(item, v, f"{key}[{i}].") for i, v in enumerate(value))  # type: ignore[arg-type]
        return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if isinstance(tp, types.UnionType) or origin is typing.Union:
        for arm in typing.get_args(tp):
            try:
                return _coerce(key, value, arm)
            except ConfigError:
                continue
    elif origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and "on" in choices and "off" in choices:
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value in choices:
            return value
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    if origin is Literal:
        raise ConfigError(f"{key}={shown(value)} is not a valid choice (choose {_describe(tp)})")
    raise ConfigError(f"{key}={shown(value)} has the wrong type (expected {_describe(tp)})")


def _section(tp: Any) -> type | None:
    """The dataclass of a section's annotation (`X` or an optional `X | None`), else None."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1 and isinstance(arms[0], type) and dataclasses.is_dataclass(arms[0]):
            return arms[0]
    return None


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"unknown config key {shown(key)} ({hint}valid: {', '.join(valid)})")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {shown(data)}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise _unknown_key(dotted, names)
        tp, section = hints[key], _section(hints[key])
        if section is not None and not (value is None and section is not tp):  # an optional section may be null
            kwargs[key] = _build(section, value, f"{dotted}.")
        elif section is not None:
            kwargs[key] = None
        else:
            kwargs[key] = _coerce(dotted, value, tp)
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain data (as read from YAML)."""
    return validate(_build(Config, data, ""))


def _plain(value: Any) -> Any:
    # YAML's safe dumper knows lists, not tuples (the frozen config's sequences)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value


def to_dict(cfg: Config) -> dict[str, Any]:
    return _plain(dataclasses.asdict(cfg))


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `a.b=value` override to nested plain data; the value is parsed as YAML."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {shown(override)} must look like section.key=value")
    parts = key.split(".")
    cls: type = Config
    node = data
    for depth, part in enumerate(parts):
        dotted = ".".join(parts[: depth + 1])
        hints = _hints(cls)
        if part not in hints:
            raise _unknown_key(dotted, [f.name for f in dataclasses.fields(cls)])
        section = _section(hints[part])
        if depth == len(parts) - 1:
            if section is hints[part]:  # an optional section may be set whole: model.moe=null or {}
                raise ConfigError(f"override {key!r} names a section; give one of its keys")
            node[part] = parse_yaml(raw, f"override {shown(override)}") if raw else ""
            return
        if section is None:
            raise ConfigError(f"override {key!r}: {dotted!r} is a value, not a section")
        cls = section
        if not isinstance(node.get(part), dict):  # absent, or an optional section set to null
            node[part] = {}
        node = node[part]


class _DuplicateKey(yaml.YAMLError):
    """A mapping names one key twice (YAML requires keys to be unique)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a mapping that names a key twice is an error: PyYAML keeps the
    last value in silence, so a config could say one thing on line 3 and train another."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then a key of base again is an override, not a repeat
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, collections.abc.Hashable):
                continue  # the base class says why such a key cannot be
            line = key_node.start_mark.line + 1
            if key in lines:
                raise _DuplicateKey(f"key {shown(key)} appears twice (lines {lines[key]} and {line}); keep one")
            lines[key] = line
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, where: str) -> Any:
    """`text` as plain data, or a one-line ConfigError that starts with `where`."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only, no objects
    except _DuplicateKey as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where}: not valid YAML{at} ({exc.problem or exc.context})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML ({str(exc).splitlines()[0][:200]})") from None
    except RecursionError:  # nested past the parser's depth
        raise ConfigError(f"{where}: not valid YAML (nested too deeply)") from None
    except ValueError as exc:  # an integer past Python's digit limit, a date out of range
        raise ConfigError(f"{where}: a value YAML cannot build ({str(exc)[:200]})") from None
    _check_expansion(data, where)
    return data


# A config has a few hundred values. Aliases share what they name, so the data YAML builds stays
# small while a walk of it (any check, any message) visits every use of every alias: a 400-byte
# file can stand for 10^9 values. The data is walked once, counting, and refused past this.
YAML_VALUES_MAX = 100_000


def _check_expansion(data: Any, where: str) -> None:
    seen, stack = 0, [data]
    while stack:
        value = stack.pop()
        seen += 1
        if seen > YAML_VALUES_MAX:
            raise ConfigError(f"{where}: the YAML stands for more than {YAML_VALUES_MAX} values (aliases that "
                              "repeat aliases?); a config has a few hundred")
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _read_config_text(path: Path) -> str:
    """The file's text, or a one-line ConfigError saying why it cannot be a config."""
    if path.is_dir():
        raise ConfigError(f"config {str(path)!r} is a directory, not a YAML file (e.g. configs/tiny.yaml)")
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}: "
                          f"0x{exc.object[exc.start]:02x}); save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({exc.strerror})") from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (None: all defaults), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        loaded = parse_yaml(_read_config_text(path), str(path))
        if loaded is None:
            # an empty file (or only comments) would train the built-in defaults: not what was meant
            raise ConfigError(f"config file {str(path)!r} is empty (no sections; start from configs/tiny.yaml)")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded
    for override in overrides:
        apply_override(data, override)
    return from_dict(data)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_hash(cfg: Config) -> str:
    """A short stable hash of the resolved config (recorded with checkpoints and runs)."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- validation


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]


# Every number must be finite (NaN passes every `<` check) and fit in 64 bits (torch's and
# numpy's integers); these must also lie in their interval: (low, high, low closed, high closed).
INT_MAX = 2**63 - 1
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "model.dropout": (0.0, 1.0, True, False), "model.rope_theta": (0.0, math.inf, False, False),
    "model.norm_eps": (0.0, math.inf, False, False), "model.init_std": (0.0, math.inf, True, False),
    "optim.beta1": (0.0, 1.0, True, False), "optim.beta2": (0.0, 1.0, True, False),
    "optim.eps": (0.0, math.inf, False, False), "train.peak_tflops": (0.0, math.inf, False, False),
    "preflight.burn_s": (0.0, math.inf, True, False), "supervisor.loss_limit": (-math.inf, math.inf, False, False),
}


def _check_numbers(section: Any, prefix: str) -> None:
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_numbers(value, f"{key}.")
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _check_numbers(item, f"{key}[{i}].")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_MAX:
            raise ConfigError(f"{key}={shown(value)} is past the largest integer mshpc takes ({INT_MAX})")
        if key in RANGES and value is not None:
            _check_range(key, value, *RANGES[key])


def _check_range(key: str, value: float, low: float, high: float, low_closed: bool, high_closed: bool) -> None:
    if (value > low or (low_closed and value == low)) and (value < high or (high_closed and value == high)):
        return
    left, right = "[" if low_closed else "(", "]" if high_closed else ")"
    raise ConfigError(f"{key}={value} must lie in {left}{low:g}, {high:g}{right}")


def _check_minimums(section: Any, prefix: str) -> None:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_minimums(value, f"{prefix}{f.name}.")
        elif "min" in f.metadata and value is not None and value < f.metadata["min"]:
            raise ConfigError(f"{prefix}{f.name}={value} must be >= {f.metadata['min']}")


# No model anyone trains comes near it (Llama 3's largest: 4e11): past it a config holds a typo,
# and building the model would end in the OOM killer, blamed on the node.
PARAMS_MAX = 10**14


def model_params(m: ModelConfig) -> int:
    """About how many parameters model `m` has (embedding, head if untied, attention and MLP
    matrices, every expert's; norms and biases left out): for bounds, not for reports
    (plan/memory.py)."""
    hd = m.head_dim if m.head_dim is not None else m.d_model // max(m.n_head, 1)
    attention = m.d_model * (m.n_head + 2 * m.kv_heads) * hd + m.n_head * hd * m.d_model
    mlp = m.d_model * m.ffn_width * (3 if m.mlp == "swiglu" else 2)
    if m.moe is not None:
        width = m.moe.expert_ffn_dim if m.moe.expert_ffn_dim is not None else m.ffn_width
        mlp = max(mlp, 3 * m.d_model * width * (m.moe.n_experts + m.moe.n_shared_experts))
    return m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.n_layer * (attention + mlp)


def _check_model(m: ModelConfig) -> None:
    if model_params(m) > PARAMS_MAX:
        raise ConfigError(f"the model has about {model_params(m):.2g} parameters (model.n_layer={m.n_layer}, "
                          f"model.d_model={m.d_model}, model.vocab_size={m.vocab_size}), past any model "
                          f"({PARAMS_MAX:.0e}); is a size mistyped?")
    if m.head_dim is None and m.d_model % m.n_head:
        raise ConfigError(
            f"model.n_head={m.n_head} does not divide model.d_model={m.d_model} "
            f"(choose {_divisors(m.d_model)}, or set model.head_dim)"
        )
    if m.head_size % 2:
        what = "model.head_dim" if m.head_dim is not None else "model.d_model/model.n_head"
        raise ConfigError(f"{what}={m.head_size} must be even for rotary embeddings")
    if m.sliding_window is not None and m.sliding_window < 1:
        raise ConfigError(f"model.sliding_window={m.sliding_window} must be >= 1 or null (off)")
    if m.mlp == "swiglu" and m.mlp_bias:
        # Llama's gate, up and down projections have no biases, and the fused gate adds none
        raise ConfigError("model.mlp_bias=true is not available with model.mlp=swiglu (choose "
                          "model.mlp_bias=false, or model.mlp=gelu)")
    if m.n_head % m.kv_heads:
        raise ConfigError(
            f"model.n_kv_head={m.n_kv_head} does not divide model.n_head={m.n_head} "
            f"(choose {_divisors(m.n_head)})"
        )
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be > "
                          f"model.rope_low_freq_factor={m.rope_low_freq_factor} (Llama 3.1: 4.0 and 1.0)")


def _check_moe(m: ModelConfig) -> None:
    moe = m.moe
    if moe is None:
        return
    if moe.top_k > moe.n_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} is above model.moe.n_experts={moe.n_experts} "
                          f"(choose 1 to {moe.n_experts})")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(f"model.moe.capacity_factor={moe.capacity_factor} must be > 0, or null (dropless)")
    if m.moe_layers == 0:
        raise ConfigError(f"model.moe.first_dense_layers={moe.first_dense_layers} and model.moe.every={moe.every} "
                          f"leave no mixture-of-experts layer among model.n_layer={m.n_layer} (lower them, or "
                          "set model.moe to null)")
    if m.parallel_block:
        # the parallel block feeds attention and the MLP one normed input and fuses their tp
        # collectives; Mixtral, Qwen and DeepSeek are serial blocks
        raise ConfigError("model.moe with model.parallel_block=true is not available (choose "
                          "model.parallel_block=false)")
    if moe.shared_expert_gate and moe.n_shared_experts == 0:
        raise ConfigError("model.moe.shared_expert_gate=true needs model.moe.n_shared_experts >= 1")


def _check_ep(m: ModelConfig, p: ParallelConfig) -> None:
    """ep against the model; against dp where dp is fitted to the world (resolve_world)."""
    if p.ep == 1:
        return
    if m.moe is None:
        raise ConfigError(f"parallel.ep={p.ep} needs a mixture of experts (set model.moe, or parallel.ep=1)")
    if m.moe.n_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide model.moe.n_experts={m.moe.n_experts} "
                          f"(choose {_divisors(m.moe.n_experts)})")


def check_layout(*, model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig) -> None:
    """Whether the engine can run `model` split as `parallel` says (a ConfigError naming the
    setting and the choices if not); `mshpc plan`'s automatic layout asks it of each candidate."""
    p, m = parallel, model
    if m.n_head % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide model.n_head={m.n_head} (choose {_divisors(m.n_head)})"
        )
    kv = m.kv_heads
    if kv % p.tp and p.tp % kv:
        # kv heads are split over tp like q heads when kv >= tp, else each tp rank keeps a copy
        # of the one its q heads read (Megatron's rule): either way one divides the other
        raise ConfigError(
            f"parallel.tp={p.tp} and model.n_kv_head={kv}: one must divide the other (kv heads are "
            f"split over tp, or replicated when fewer; choose tp among {_divisors(kv)} or a multiple of {kv})"
        )
    if kv < p.tp and optim.name == "lamb":
        # LAMB's per-weight trust ratio would count each replicated kv head once per copy
        raise ConfigError(f"optim.name='lamb' with model.n_kv_head={kv} < parallel.tp={p.tp} (replicated kv "
                          f"heads) is not available (choose optim.name='adamw', or parallel.tp <= {kv})")
    for key in ("mlp_bias", "qkv_bias"):
        if getattr(m, key) and p.tp > 1:
            # the tensor-parallel layers carry no biases yet (Megatron splits a column-parallel
            # bias with its rows and adds a row-parallel one after the reduce-scatter)
            raise ConfigError(f"model.{key}=true is not available with parallel.tp={p.tp} (choose "
                              f"model.{key}=false, or parallel.tp=1)")
    if m.seq_len % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide model.seq_len={m.seq_len} (sequence parallelism "
            f"splits the sequence; choose a seq_len that is a multiple of {p.tp})"
        )
    stages = p.pp * p.virtual_stages
    if m.n_layer % stages:
        raise ConfigError(
            f"parallel.pp*parallel.virtual_stages={stages} does not divide "
            f"model.n_layer={m.n_layer} (choose a product among {_divisors(m.n_layer)})"
        )
    if p.virtual_stages > 1 and p.pp == 1:
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.pp > 1 "
                          "(choose virtual_stages 1, or pp >= 2)")
    if p.virtual_stages > 1 and train.grad_accum % p.pp:
        raise ConfigError(f"interleaved 1F1B needs train.grad_accum={train.grad_accum} divisible by "
                          f"parallel.pp={p.pp} (choose a multiple of {p.pp}, or virtual_stages 1)")
    if p.bucket_mb <= 0:
        raise ConfigError(f"parallel.bucket_mb={p.bucket_mb} must be > 0 (MiB of fp32 gradients per bucket)")
    _check_ep(m, p)
    _check_zero_stage(p, m)


def _check_zero_stage(p: ParallelConfig, m: ModelConfig) -> None:
    if p.zero_stage == 2:
        for key, default in (("zero3_blocks_per_unit", 1), ("reshard_after_forward", True)):
            if getattr(p, key) != default:
                raise ConfigError(f"parallel.{key}={getattr(p, key)} applies to ZeRO stage 3 only "
                                  "(set parallel.zero_stage=3, or leave it unset)")
        return
    chunk = m.n_layer // (p.pp * p.virtual_stages)  # a unit never spans two pipeline chunks
    if p.zero3_blocks_per_unit > chunk:
        raise ConfigError(f"parallel.zero3_blocks_per_unit={p.zero3_blocks_per_unit} exceeds the {chunk} blocks "
                          f"of a pipeline chunk (choose 1 to {chunk})")


def _check_diagnose(d: DiagnoseConfig) -> None:
    for key in ("straggler_threshold", "mfu_decline", "straggler_warn_below", "mfu_warn_decline"):
        value = getattr(d, key)
        if not 0 < value < 1:
            raise ConfigError(f"diagnose.{key}={value} must be between 0 and 1 (a fraction)")


def _check_data(d: DataConfig) -> None:
    if d.sources and d.path is not None:
        raise ConfigError("data.path and data.sources are both set (a blend names its sources in data.sources; "
                          "choose one)")
    for i, src in enumerate(d.sources):
        if not src.path:
            raise ConfigError(f"data.sources[{i}].path is empty (a dataset folder or a Megatron .bin/.idx prefix)")
        if not src.weight >= 0 or src.weight == float("inf"):
            raise ConfigError(f"data.sources[{i}].weight={src.weight} must be a finite number >= 0")
    if d.sources and sum(src.weight for src in d.sources) <= 0:
        raise ConfigError("data.sources: every weight is 0 (give at least one source a weight > 0)")
    if not 0 <= d.indexed_val_fraction < 1:
        raise ConfigError(f"data.indexed_val_fraction={d.indexed_val_fraction} must be in [0, 1) (e.g. 0.01)")


# run.name becomes a folder, a Slurm job name and part of generated scripts: a plain name only
RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _check_run(r: RunConfig) -> None:
    if not RUN_NAME.fullmatch(r.name) or r.name in (".", ".."):
        raise ConfigError(f"run.name={shown(r.name)} is not a plain name (choose 1 to 128 letters, digits and . _ -, "
                          "not . or ..)")
    if any(not c.isprintable() for c in r.out_dir):
        raise ConfigError(f"run.out_dir={shown(r.out_dir)} holds a control character (a newline would end a line "
                          "of the job scripts it goes into)")


def _check_loggers(r: RunConfig) -> None:
    if "jsonl" not in r.loggers:
        raise ConfigError(f"run.loggers={list(r.loggers)} must include 'jsonl' (metrics.jsonl is what "
                          "resume and mshpc diagnose read; add tensorboard or wandb beside it)")
    if len(set(r.loggers)) != len(r.loggers):
        raise ConfigError(f"run.loggers={list(r.loggers)} names a logger twice (name each once)")


def _check_supervisor(s: SupervisorConfig) -> None:
    # a rank beats every interval and its node's relay passes the beats on once an interval: two
    # intervals of silence are ordinary
    if 0 < s.heartbeat_timeout_s < 3 * s.heartbeat_interval_s:
        raise ConfigError(f"supervisor.heartbeat_timeout_s={s.heartbeat_timeout_s:g} must be at least 3 x "
                          f"supervisor.heartbeat_interval_s={s.heartbeat_interval_s:g} (or 0: off)")


def validate(cfg: Config) -> Config:
    """Check every value and combination; return the config unchanged."""
    _check_numbers(cfg, "")  # first: a NaN would pass every check after it
    _check_minimums(cfg, "")
    _check_model(cfg.model)
    _check_moe(cfg.model)
    check_layout(model=cfg.model, parallel=cfg.parallel, train=cfg.train, optim=cfg.optim)
    if cfg.data.per_node_reader and cfg.data.loader == "dali":
        raise ConfigError("data.per_node_reader=true reads with the torch reader into shared memory; "
                          "it does not combine with data.loader='dali' (choose 'auto' or 'torch')")
    _check_data(cfg.data)
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} must be <= optim.lr={cfg.optim.lr}")
    if cfg.optim.decay_fraction > 1:
        raise ConfigError(f"optim.decay_fraction={cfg.optim.decay_fraction} must be between 0 and 1 "
                          "(the share of train.steps wsd spends decaying; 0.2 is usual)")
    if not 0 <= cfg.plan.memory_headroom < 1:
        raise ConfigError(f"plan.memory_headroom={cfg.plan.memory_headroom} must be in [0, 1) "
                          "(the share of device memory left free; 0.1 is usual)")
    _check_diagnose(cfg.diagnose)
    _check_run(cfg.run)
    _check_loggers(cfg.run)
    _check_supervisor(cfg.supervisor)
    if cfg.recovery.replay and cfg.recovery.snapshot_interval_steps != 1:
        raise ConfigError(f"recovery.replay=true replays a step from the snapshot taken just before it: it needs "
                          f"recovery.snapshot_interval_steps=1 (got {cfg.recovery.snapshot_interval_steps})")
    return cfg


def resolve_world(cfg: Config, world_size: int) -> Config:
    """Fit the data-parallel degree to the launched world: dp = world / (tp * pp)."""
    model_parallel = cfg.parallel.tp * cfg.parallel.pp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp*parallel.pp={model_parallel} "
            f"(launch a multiple of {model_parallel} ranks)"
        )
    dp = world_size // model_parallel
    if dp % cfg.parallel.ep:
        raise ConfigError(
            f"world size {world_size} gives dp={dp} (world / (tp*pp)), which parallel.ep={cfg.parallel.ep} does not "
            f"divide (launch a multiple of tp*pp*ep={model_parallel * cfg.parallel.ep} ranks)"
        )
    if dp == cfg.parallel.dp:
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=dp))
