"""Claim: which way grouped-query attention should reach SDPA on this machine: SDPA's own
`enable_gqa=True` (k and v keep their kv heads) or k and v expanded to the q heads with
repeat_interleave first. Forward + backward of the attention core at the tiny and the gpt-125m
shapes, causal (SDPA's is_causal path) and with a sliding-window mask, interleaved round by
round so both see the same machine load; the median round counts.

    .venv/bin/python benchmarks/gqa_attention.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mshpc.bench import harness

# (name, batch, seq, n_head, n_kv_head, head_dim): tiny is configs/tiny.yaml with 2 kv heads;
# 125m is configs/gpt-125m.yaml's heads at a 512-token window of its sequence, 4 kv heads
SHAPES = [("tiny", 8, 128, 4, 2, 64), ("tiny-mqa", 8, 128, 4, 1, 64), ("125m", 2, 512, 12, 4, 64),
          ("125m-mqa", 2, 512, 12, 1, 64)]


def native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


def expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


def time_once(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> float:
    start = time.perf_counter()
    fn(q, k, v, mask).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    harness.add_rounds(ap, 5, "rounds; the two paths take turns in each")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name, b, s, nh, kv, hd in SHAPES:
        for masked in (False, True):
            q = torch.randn(b, nh, s, hd, requires_grad=True)
            k, v = (torch.randn(b, kv, s, hd, requires_grad=True) for _ in range(2))
            i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
            mask = (j <= i) & (j > i - s // 4) if masked else None  # a window of s/4
            for fn in (native, expanded):
                time_once(fn, q, k, v, mask)  # warm-up
            rounds = [(time_once(native, q, k, v, mask), time_once(expanded, q, k, v, mask))
                      for _ in range(args.rounds)]
            harness.emit({"bench": "gqa_attention", "metric": "enable_gqa_fwd_bwd_vs_repeat_interleave", "unit": "s",
                          **harness.paired([r[0] for r in rounds], [r[1] for r in rounds], digits=5), "shape": name,
                          "path": "window mask" if masked else "causal", "load_avg": harness.load_average()})


if __name__ == "__main__":
    main()
