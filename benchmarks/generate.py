"""Claim: decoding with the key/value cache is faster than recomputing the whole sequence for
every new token, and by how much, on CPU at the tiny and the gpt-125m shapes (random weights,
greedy, batch 1): new tokens per second with and without the cache, side by side in one run.

    .venv/bin/python benchmarks/generate.py [--prompt-tokens 64] [--new-tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from mshpc.bench import harness
from mshpc.bench.harness import REPO
from mshpc.config import load_config
from mshpc.generate import SampleOptions, decode
from mshpc.model.gpt import GPT


def tokens_per_s(model: GPT, prompt: list[int], opts: SampleOptions, cache: bool) -> tuple[float, float]:
    """New tokens per wall second, and per CPU second of this process (what a shared machine's
    load does not change)."""
    start, cpu = time.perf_counter(), time.process_time()
    new = decode(model, prompt, opts, cache=cache)
    return len(new) / (time.perf_counter() - start), len(new) / (time.process_time() - cpu)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)  # batch 1 decoding: one thread, no spin-waits
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in ("tiny", "gpt-125m"):
        cfg = load_config(REPO / "configs" / f"{name}.yaml").model
        torch.manual_seed(0)
        model = GPT(cfg).eval()
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,)).tolist()
        opts = SampleOptions(max_new_tokens=min(args.new_tokens, cfg.seq_len - len(prompt)), greedy=True)
        decode(model, prompt[:8], SampleOptions(max_new_tokens=4, greedy=True))  # warm-up (kernels, allocator)
        (cached, cached_cpu), (full, full_cpu) = (tokens_per_s(model, prompt, opts, cache) for cache in (True, False))
        for metric, ours, base in (("tokens_per_s_kv_cache_vs_full_recompute", cached, full),
                                   ("tokens_per_cpu_s_kv_cache_vs_full_recompute", cached_cpu, full_cpu)):
            harness.emit(harness.record("generate", metric, ours, "tokens/s", base, digits=1, shape=name,
                                        prompt_tokens=len(prompt), new_tokens=opts.max_new_tokens,
                                        load_avg=harness.load_average()))


if __name__ == "__main__":
    main()
