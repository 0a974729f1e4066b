"""What a rank contributes to a checkpoint: named slices of global tensors.

A slice is elements [start, start + numel) of the global tensor's row-major flattening, so a
ZeRO shard (a contiguous range of a flattened parameter) and a whole replicated tensor
(start 0, all elements) are described alike, and a reader at another layout can ask for any
range it needs. A leaf (torch only), so ZeRO describes its shards without importing the
checkpoint package that writes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSlice:
    tensor: torch.Tensor  # this rank's part; any shape, read flattened
    global_shape: tuple[int, ...]
    start: int = 0  # flat offset of tensor's first element in the global tensor

    def __post_init__(self) -> None:
        total = math.prod(self.global_shape)
        assert 0 <= self.start and self.start + self.tensor.numel() <= total, (
            self.start, self.tensor.numel(), self.global_shape)

    @staticmethod
    def whole(tensor: torch.Tensor) -> TensorSlice:
        return TensorSlice(tensor, tuple(tensor.shape), 0)


# read(name, start, numel) -> a 1-D tensor of those flat elements of the named global tensor.
SliceReader = Callable[[str, int, int], torch.Tensor]
