"""Hugging Face export: time to write a model's folder (best of 3) against transformers' own save_pretrained
of the same weights, and how close transformers' logits come to mshpc's, for a GPT-NeoX-style
and a Llama-style model of GPT-2 small's shape (12 layers, d 768, 12 heads, vocabulary 50304).

JSON lines: per architecture, write_seconds_vs_save_pretrained (ratio ours / theirs, in the same
run) and max_relative_logit_diff (max |a - b| / max |b| over (2, 128) tokens, fp32).

    .venv/bin/python benchmarks/hf_export.py [--n-layer 12] [--d-model 768]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch

from mshpc.bench import harness
from mshpc.config import ModelConfig
from mshpc.data.tokenizer import ByteTokenizer
from mshpc.interop.hf_export import write_hf
from mshpc.model.gpt import GPT

REPEATS = 3


def measure(m: ModelConfig, tmp: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = GPT(m).eval()
    weights = {n: p.detach() for n, p in model.named_parameters()}
    ours, theirs = [], []
    hf = None
    for rep in range(REPEATS):  # alternating, the best of each: the first writes pay a cold page cache
        t0 = time.perf_counter()
        write_hf(tmp / f"ours{rep}", m, weights, ByteTokenizer())
        ours.append(time.perf_counter() - t0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = hf or AutoModelForCausalLM.from_pretrained(tmp / "ours0").eval()
            t0 = time.perf_counter()
            hf.save_pretrained(tmp / f"theirs{rep}")
            theirs.append(time.perf_counter() - t0)
    ours_s, theirs_s = min(ours), min(theirs)
    idx = torch.randint(0, m.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = model(idx).float(), hf(idx).logits.float()
    arch = json.loads((tmp / "ours0/config.json").read_text())["architectures"][0]
    diff = float((got - ref).abs().max() / ref.abs().max())
    return [harness.record("hf_export", "write_seconds_vs_save_pretrained", ours_s, "s", theirs_s, digits=3, arch=arch,
                           load_avg=harness.load_average()),
            harness.record("hf_export", "max_relative_logit_diff", diff, "1", digits=12, arch=arch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    args = parser.parse_args()
    shape = dict(vocab_size=50304, seq_len=128, n_layer=args.n_layer, n_head=12, d_model=args.d_model,
                 fused_kernels="off")
    for m in (ModelConfig(**shape, norm="layernorm", mlp="gelu", parallel_block=True),
              ModelConfig(**shape, norm="rmsnorm", mlp="swiglu", n_kv_head=4, ffn_dim=2048, tie_embeddings=False)):
        with tempfile.TemporaryDirectory() as tmp:
            for row in measure(m, Path(tmp)):
                harness.emit(row)


if __name__ == "__main__":
    main()
