"""Mixtures of experts to Hugging Face and back with real expert-parallel training: a tiny
Mixtral, Qwen2-MoE and Qwen3-MoE, each made by transformers, imported, trained at ep=2 on 2
ranks (each rank holding half the experts) and exported from the ep=2 checkpoint; transformers
then computes the checkpoint's logits (fp32, max relative difference <= 1e-5)."""

from __future__ import annotations

import warnings

import pytest
import transformers
from support.cli_runner import mshpc, read_metrics
from support.hf_models import FAST, MAX_RELATIVE_DIFF, checkpoint_logits, hf_logits, relative_diff, run_tokens

from mshpc.interop.hf_export import export_hf
from mshpc.interop.hf_import import import_config

SHAPE = dict(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=32, num_experts_per_tok=2)
MODELS = {  # arch: (config, steps)
    "MixtralForCausalLM": (transformers.MixtralConfig(**SHAPE, num_local_experts=4, intermediate_size=48), 20),
    "Qwen2MoeForCausalLM": (transformers.Qwen2MoeConfig(**SHAPE, num_experts=4, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=64, intermediate_size=96,
                                                        qkv_bias=False), 4),
    "Qwen3MoeForCausalLM": (transformers.Qwen3MoeConfig(**SHAPE, num_experts=4, moe_intermediate_size=32,
                                                        intermediate_size=96, head_dim=32, norm_topk_prob=True), 4),
}


@pytest.mark.parametrize("arch", list(MODELS))
def test_imported_moe_trains_at_ep2_and_exports(arch, tmp_path, corpus_cache):
    config, steps = MODELS[arch]
    hf = getattr(transformers, arch)(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(tmp_path / "hf")
    cfg = import_config(tmp_path / "hf", tmp_path / "moe.yaml")
    assert cfg.model.moe is not None and cfg.model.moe.n_experts == 4
    sets = [*FAST, f"train.steps={steps}", f"checkpoint.interval_steps={steps}", "train.micro_batch=4",
            "parallel.ep=2", "optim.warmup_steps=2", f"run.out_dir={tmp_path}", "run.name=moe",
            f"data.cache_dir={corpus_cache}"]
    trained = mshpc("train", str(tmp_path / "moe.yaml"), "--nproc", "2", *[a for s in sets for a in ("--set", s)])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert len(read_metrics(tmp_path / "moe")) == steps
    lines = export_hf(tmp_path / "moe", tmp_path / "exported")
    assert f"as {arch}" in lines[0]
    idx = run_tokens(257, 32)
    got = hf_logits(tmp_path / "exported", idx)
    assert relative_diff(got, checkpoint_logits(tmp_path / "moe", idx)) <= MAX_RELATIVE_DIFF
    assert relative_diff(got, hf_logits(tmp_path / "hf", idx)) > 1e-4  # training moved the weights
