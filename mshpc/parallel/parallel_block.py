"""The parallel block under tensor + sequence parallelism with its communication fused
(MegaScale sec. 3.1): attention and the MLP read one normed input, so its all-gather is done once
and feeds both column-parallel GEMMs (qkv and mlp.fc), and their row-parallel outputs are added
before one reduce-scatter, whose chunks travel while the next chunk's projection GEMMs run
(`tensor.SharedScatter`; the gather overlaps the same way). Per layer and micro-batch: 1
all-gather + 1 reduce-scatter forward where the serial block (Megatron) issues 2 + 2.

Weights keep their names and tp splits (attn.qkv.weight [q; k; v] by heads, mlp.fc.weight by
rows; the projections by columns), so a checkpoint of the unfused block loads here and back.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist

from mshpc.parallel.tensor import PartialRowLinear, SharedGather, SharedInputSlot, SharedScatter
from mshpc.parallel.tp_split import TpSplit

log = logging.getLogger(__name__)


def fusable(parallel_block: bool, dropout: float, asked: bool = True) -> tuple[bool, str]:
    """Whether a block runs fused, and why not: the fused block applies the branches' dropout
    to row-parallel partial sums, which is the unfused block's only without dropout."""
    if not parallel_block:
        return False, "serial block: attention's output feeds the MLP's norm"
    if not asked:
        return False, "parallel.tp_fused_block=false"
    if dropout > 0:
        return False, f"model.dropout={dropout} (the fused block drops out of partial sums)"
    return True, "parallel block, no dropout"


@functools.cache
def log_choice(fused: bool, reason: str) -> None:
    log.info("tensor-parallel block: %s (%s)", "fused parallel block" if fused else "unfused", reason)


def fuse_parallel_block(block: Any, local: dict[str, tuple[torch.Tensor, TpSplit]],
                        group: dist.ProcessGroup, chunks: int) -> None:
    """Swap `block`'s tp parts for the fused ones; `local` holds this rank's part of each of
    attn.qkv, mlp.fc, attn.proj and mlp.proj with its split. Its forward is then `fused_forward`."""
    attn, mlp = block.attn, block.mlp
    attn.qkv, mlp.fc = (SharedInputSlot(*local[name], group) for name in ("attn.qkv", "mlp.fc"))
    attn.proj, mlp.proj = (PartialRowLinear(local[name][0]) for name in ("attn.proj", "mlp.proj"))
    # registered after attn and mlp: the weights' first (checkpoint) names stay theirs
    block.shared_gather = SharedGather([attn.qkv, mlp.fc], group, chunks)
    block.shared_scatter = SharedScatter([attn.proj, mlp.proj], group, chunks)
    block.forward = functools.partial(fused_forward, block)


def fused_forward(block: Any, x: torch.Tensor, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
    """x (b, s/tp, d) -> x + attn(ln_1(x)) + mlp(ln_1(x)), (b, s/tp, d). Collective over the
    block's tp group. No dropout here: `fusable` leaves blocks with dropout unfused."""
    h, _ = block.ln_1(x)  # (b, s/tp, d)
    qkv, fc = block.shared_gather(h)  # (b, s, 3d/tp), (b, s, ffn/tp): one all-gather of h
    heads, hidden = block.attn.heads(qkv, doc_mask), block.mlp.hidden(fc)  # this rank's heads and columns
    return x + block.shared_scatter(heads, hidden)  # both projections, one reduce-scatter of their sum
