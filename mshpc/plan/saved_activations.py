"""Measure what mshpc's blocks keep for backward: the bytes autograd saves per layer and
micro-batch (torch.autograd.graph.saved_tensors_hooks), deduplicated by storage, so a view
counts the whole storage it pins and a tensor saved twice counts once. What the plan's formula
(plan/memory.py, layer_activation_bytes) must predict.

A checkpointed region saves nothing autograd sees until it is recomputed: what it keeps is its
inputs, which the non-reentrant checkpoint holds for the recomputation, so those are counted
as saved by the layer that calls it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mshpc.config import ModelConfig, ParallelConfig
from mshpc.model.gpt import GPT
from mshpc.parallel.apply import apply_activation_checkpointing, apply_tp


class SavedBytes:
    """Storages first saved while each layer ran, by layer index; each storage counted once."""

    def __init__(self, state: set[int]) -> None:
        self.layer: int | None = None
        self.seen: set[int] = set(state)  # the model's parameters and buffers: state, not activations
        self.keep: list[torch.Tensor] = []  # keeps each counted storage alive, so no id is reused
        self.bytes: dict[int, int] = {}
        self.tensors: dict[int, list[tuple[tuple[int, ...], torch.dtype, int, str]]] = {}

    def count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr() or id(storage)
        if self.layer is None or key in self.seen or storage.nbytes() == 0 or _weight_copy(t):
            return
        self.seen.add(key)
        self.keep.append(t)
        self.bytes[self.layer] = self.bytes.get(self.layer, 0) + storage.nbytes()
        self.tensors.setdefault(self.layer, []).append((tuple(t.shape), t.dtype, storage.nbytes(), type(t.grad_fn).__name__))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count(t)
        return t

    @contextlib.contextmanager
    def in_layer(self, index: int) -> Iterator[None]:
        self.layer = index
        try:
            yield
        finally:
            self.layer = None


WEIGHT_COPY_OPS = ("ToCopyBackward0", "TBackward0")  # autocast's cast of a weight, and its transpose


def _weight_copy(t: torch.Tensor) -> bool:
    """A weight cast by autocast (its cache holds it for the step: O(weights), not O(s b h)):
    activations here are (b, s, ...), of three dims or more, or (b * s, ...) views of them."""
    return t.grad_fn is not None and type(t.grad_fn).__name__ in WEIGHT_COPY_OPS and t.dim() == 2


def _holding_inputs(fn: Callable[..., Any], record: SavedBytes) -> Callable[..., Any]:
    """fn, its tensor arguments counted as saved: a checkpointed fn holds them for backward."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                record.count(a)
        return fn(*args, **kwargs)

    return wrapped


def _watch(model: GPT, checkpointing: str, record: SavedBytes) -> None:
    blocks: dict[str, Any] = dict(model.layers.items())  # Any: their forwards get wrapped
    for key, block in blocks.items():
        if checkpointing == "full":
            block.forward = _holding_inputs(block.forward, record)
        elif checkpointing == "selective":
            block.attn.attend = _holding_inputs(block.attn.attend, record)
        call = block.forward

        def forward(*args: Any, _call: Callable[..., Any] = call, _i: int = int(key), **kw: Any) -> Any:
            with record.in_layer(_i):
                return _call(*args, **kw)

        block.forward = forward


def measure(m: ModelConfig, checkpointing: str, micro_batch: int, group: dist.ProcessGroup | None = None,
            documents: int = 1, autocast: torch.dtype | None = None) -> SavedBytes:
    """One forward of a GPT of `m` (tensor-parallel over `group` when given: collective over it)
    on `micro_batch` sequences of `documents` packed documents each; returns what each layer
    saved. Dropout off: the measure is of what is kept, not of which elements are dropped."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(m, dropout=0.0))
    if group is not None and dist.get_world_size(group) > 1:
        apply_tp(model, group, ParallelConfig(tp=dist.get_world_size(group), tp_overlap=False))
    apply_activation_checkpointing(model, checkpointing)
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    record = SavedBytes(state)
    _watch(model, checkpointing, record)
    idx = torch.randint(0, m.vocab_size, (micro_batch, m.seq_len), generator=torch.Generator().manual_seed(1))
    segments = None
    if documents > 1:  # equal documents back to back
        segments = (torch.arange(m.seq_len) * documents // m.seq_len).expand(micro_batch, -1)
    with torch.autograd.graph.saved_tensors_hooks(record.pack, lambda t: t), \
            torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        model(idx, segments)
    return record


def layer_bytes(record: SavedBytes, n_layer: int) -> int:
    """A middle layer's bytes: the first layer's input is the embedding's output, which no
    other layer's is (it may be held in another dtype or storage)."""
    return record.bytes.get(n_layer // 2, 0)
