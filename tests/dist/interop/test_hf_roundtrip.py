"""Hugging Face export and import with real multi-rank training (the CLI's local launcher): a model
trained at dp=2 (started from an imported Hugging Face folder) or at tp=2 x pp=2 exports to a
folder whose transformers model computes the checkpoint's logits. Import and export run in this
process; their CLI commands are tested in tests/unit/interop."""

import warnings

import pytest
from support.cli_runner import mshpc, read_metrics, train_args
from support.hf_models import FAST, MAX_RELATIVE_DIFF, checkpoint_logits, hf_logits, relative_diff, run_tokens
from transformers import LlamaConfig, LlamaForCausalLM

from mshpc.checkpoint.manifest import read_manifest
from mshpc.checkpoint.paths import latest_step, step_dir
from mshpc.interop.hf_export import export_hf
from mshpc.interop.hf_import import import_config


def test_imported_llama_trains_20_steps_at_dp2_and_exports(tmp_path, corpus_cache):
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(tmp_path / "hf")
    import_config(tmp_path / "hf", tmp_path / "llama.yaml")  # in this process: the CLI's own is a unit test
    sets = [*FAST, "train.steps=20", "checkpoint.interval_steps=20", "train.micro_batch=4",
            "optim.warmup_steps=2", f"run.out_dir={tmp_path}", "run.name=llama", f"data.cache_dir={corpus_cache}"]
    trained = mshpc("train", str(tmp_path / "llama.yaml"), "--nproc", "2", *[a for s in sets for a in ("--set", s)])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert f"initial weights: {tmp_path / 'hf'}" in trained.stderr
    assert len(read_metrics(tmp_path / "llama")) == 20
    lines = export_hf(tmp_path / "llama", tmp_path / "exported", max_shard_bytes=100_000)  # a run directory
    assert "as LlamaForCausalLM" in lines[0] and (tmp_path / "exported/model.safetensors.index.json").is_file()
    idx = run_tokens(257, 32)
    got = hf_logits(tmp_path / "exported", idx)
    assert relative_diff(got, checkpoint_logits(tmp_path / "llama", idx)) <= MAX_RELATIVE_DIFF
    assert relative_diff(got, hf_logits(tmp_path / "hf", idx)) > 1e-3  # 20 steps moved the weights


LAYOUT = ["parallel.tp=2", "parallel.pp=2", "train.micro_batch=2", "train.grad_accum=2", "train.steps=2",
          "checkpoint.interval_steps=2"]


@pytest.mark.parametrize("model, arch", [
    (["model.norm=layernorm", "model.parallel_block=true"], "GPTNeoXForCausalLM"),
    (["model.norm=rmsnorm", "model.parallel_block=false", "model.mlp=swiglu", "model.n_kv_head=1",
      "model.tie_embeddings=false"], "LlamaForCausalLM"),
], ids=["neox-parallel", "llama-mqa"])
def test_tp2_pp2_checkpoint_exports(tmp_path, corpus_cache, model, arch):
    trained = mshpc(*train_args(tmp_path, corpus_cache, *FAST, *LAYOUT, *model, name="run"), "--nproc", "4")
    assert trained.returncode == 0, trained.stderr[-3000:]
    root = tmp_path / "run" / "checkpoints"
    folder = step_dir(root, latest_step(root))
    manifest = read_manifest(folder)
    assert manifest.layout == {"dp": 1, "tp": 2, "pp": 2}
    assert any(e.name.startswith("model/") and e.name.endswith("@tp1") for e in manifest.tensors)  # parts to join
    # in this process (the dp=2 test runs the CLI); a step folder: the config is found two levels up
    lines = export_hf(folder, tmp_path / "exported", max_shard_bytes=100_000)
    assert f"as {arch}" in lines[0] and (tmp_path / "exported/model.safetensors.index.json").is_file()
    idx = run_tokens(257, 32)
    assert relative_diff(hf_logits(tmp_path / "exported", idx), checkpoint_logits(tmp_path / "run", idx)) \
        <= MAX_RELATIVE_DIFF
