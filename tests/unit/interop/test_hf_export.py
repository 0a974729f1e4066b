"""mshpc -> Hugging Face: the exported folder loads in transformers and computes mshpc's logits."""

import dataclasses
import json

import pytest
import torch
from support.hf_models import (
    LLAMA31,
    LLAMA32,
    LLAMA_GQA,
    LLAMA_MQA_TIED,
    MAX_RELATIVE_DIFF,
    MISTRAL,
    NEOX_PARALLEL,
    NEOX_SERIAL,
    QWEN2,
    checkpoint_run,
    hf_logits,
    mshpc_logits,
    relative_diff,
    tokens,
)

from mshpc.data.tokenizer import ByteTokenizer
from mshpc.errors import InteropError
from mshpc.interop.hf_arch import hf_architecture
from mshpc.interop.hf_export import write_hf
from mshpc.model.gpt import GPT


def _drawn(m, seed=0):
    torch.manual_seed(seed)
    model = GPT(m)
    with torch.no_grad():  # norms and biases away from 1 and 0, so a misplaced one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("m, arch", [
    (NEOX_SERIAL, "GPTNeoXForCausalLM"), (NEOX_PARALLEL, "GPTNeoXForCausalLM"),
    (dataclasses.replace(NEOX_SERIAL, mlp_bias=True), "GPTNeoXForCausalLM"),
    (LLAMA_GQA, "LlamaForCausalLM"), (LLAMA_MQA_TIED, "LlamaForCausalLM"),
    (QWEN2, "Qwen2ForCausalLM"), (dataclasses.replace(QWEN2, sliding_window=8), "Qwen2ForCausalLM"),
    (MISTRAL, "MistralForCausalLM"), (LLAMA31, "LlamaForCausalLM"), (LLAMA32, "LlamaForCausalLM"),
    (dataclasses.replace(NEOX_PARALLEL, qkv_bias=True), "GPTNeoXForCausalLM"),
], ids=["neox-serial-untied", "neox-parallel-tied", "neox-mlp-bias", "llama-gqa-untied", "llama-mqa-tied",
        "qwen2-qkv-bias", "qwen2-window", "mistral-window", "llama3.1-rope-scaling", "llama3.2-rope-scaling",
        "neox-qkv-bias"])
def test_exported_model_computes_mshpc_logits(tmp_path, m, arch):
    model = _drawn(m)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    write_hf(tmp_path / "hf", m, weights, ByteTokenizer())
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["architectures"] == [arch]
    idx = tokens(m)
    assert relative_diff(hf_logits(tmp_path / "hf", idx), mshpc_logits(model, idx)) <= MAX_RELATIVE_DIFF


def test_export_shards_above_the_size_and_writes_an_index(tmp_path):
    model = _drawn(NEOX_SERIAL)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    files = write_hf(tmp_path / "hf", NEOX_SERIAL, weights, ByteTokenizer(), max_shard_bytes=20_000)[0]
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and "model-00001-of-" in files
    assert not (tmp_path / "hf/model.safetensors").exists()
    idx = tokens(NEOX_SERIAL)
    assert relative_diff(hf_logits(tmp_path / "hf", idx), mshpc_logits(model, idx)) <= MAX_RELATIVE_DIFF


def test_byte_tokenizer_exports_the_ids_mshpc_trains_on(tmp_path):
    from transformers import AutoTokenizer

    model = _drawn(NEOX_PARALLEL)
    write_hf(tmp_path / "hf", NEOX_PARALLEL, {n: p.detach() for n, p in model.named_parameters()}, ByteTokenizer())
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return x ** 2  # héllo, wörld ✓"
    assert tok(text)["input_ids"] == ByteTokenizer().encode(text).tolist()
    assert tok.eos_token_id == ByteTokenizer.eos_id
    assert tok.decode(tok(text)["input_ids"]) == text
    assert json.loads((tmp_path / "hf/config.json").read_text())["eos_token_id"] == ByteTokenizer.eos_id


@pytest.mark.parametrize("changes, nearest", [
    (dict(norm="rmsnorm", mlp="gelu", parallel_block=True), "layernorm + gelu + parallel block -> GPTNeoXForCausalLM"),
    (dict(norm="layernorm", mlp="swiglu", parallel_block=False), "rmsnorm + swiglu + serial block -> LlamaForCausalLM; "
     "layernorm + gelu + serial block -> GPTNeoXForCausalLM"),
])
def test_unsupported_combination_names_the_nearest_supported(changes, nearest):
    with pytest.raises(InteropError) as err:
        hf_architecture(dataclasses.replace(NEOX_SERIAL, **changes))
    assert "has no transformers equivalent" in str(err.value) and nearest in str(err.value)
    assert "\n" not in str(err.value)


def test_export_refuses_a_neox_sliding_window_and_a_used_folder(tmp_path):
    with pytest.raises(InteropError, match=r"sliding_window=8: GPTNeoXForCausalLM has no sliding window .* rmsnorm "
                                           r"\+ swiglu -> MistralForCausalLM"):
        hf_architecture(dataclasses.replace(NEOX_SERIAL, sliding_window=8))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/keep.txt").write_text("mine")
    model = GPT(NEOX_SERIAL)
    with pytest.raises(InteropError, match="not an empty folder"):
        write_hf(tmp_path / "hf", NEOX_SERIAL, {n: p.detach() for n, p in model.named_parameters()}, ByteTokenizer())
    assert (tmp_path / "hf/keep.txt").read_text() == "mine"


def test_cli_export_of_an_unsupported_model_stops_with_one_line(tmp_path, capsys):
    from support.cli_runner import REPO

    from mshpc.cli import USER_ERROR_EXIT, main

    (tmp_path / "run").mkdir()  # rmsnorm + gelu + parallel block: no checkpoint needed to say so
    (tmp_path / "run/config.yaml").write_text((REPO / "configs/tiny.yaml").read_text().replace(
        "norm: layernorm", "norm: rmsnorm"))
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == USER_ERROR_EXIT
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("mshpc: error: InteropError: model.norm=rmsnorm, model.mlp=gelu, model.parallel_block=true "
                       "has no transformers equivalent (nearest supported: layernorm + gelu + parallel block -> "
                       "GPTNeoXForCausalLM)")
    assert not (tmp_path / "out").exists()


def _run_with_checkpoint(tmp_path, m):
    from mshpc.config import Config

    model = _drawn(m)
    return model, checkpoint_run(tmp_path / "run", Config(model=m), model)


@pytest.mark.parametrize("m, arch", [(LLAMA_GQA, "LlamaForCausalLM"), (NEOX_SERIAL, "GPTNeoXForCausalLM")],
                         ids=["llama-gqa", "neox-serial"])
def test_export_of_a_run_directory_reads_its_latest_checkpoint(tmp_path, m, arch):
    # the checkpoint as dp=2 ranks write it (each whole weight in one of the 2 shards); a real
    # dp=2 run's export is tests/dist/interop/test_hf_roundtrip.py's (Llama, imported and trained)
    from mshpc.interop.hf_export import export_hf

    model, folder = _run_with_checkpoint(tmp_path, m)
    lines = export_hf(tmp_path / "run", tmp_path / "hf")
    assert lines[0].startswith(f"exported {folder} (") and f"as {arch}" in lines[0]
    idx = tokens(m)
    assert relative_diff(hf_logits(tmp_path / "hf", idx), mshpc_logits(model, idx)) <= MAX_RELATIVE_DIFF


def test_export_stops_at_a_corrupt_model_copy_and_writes_nothing(tmp_path):
    from mshpc.checkpoint.manifest import read_manifest
    from mshpc.errors import CheckpointError
    from mshpc.interop.hf_export import export_hf

    _, folder = _run_with_checkpoint(tmp_path, NEOX_SERIAL)
    [entry] = [e for e in read_manifest(folder).tensors if e.name == "model/layers.0.attn.qkv.weight"]
    with open(folder / entry.file, "r+b") as f:  # one bit of the weight's bytes, where the manifest says they are
        f.seek(entry.offset + 5)
        byte = f.read(1)[0]
        f.seek(entry.offset + 5)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(CheckpointError, match=r"checksum mismatch for tensor 'model/layers.0.attn.qkv.weight'"):
        export_hf(folder, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.export-tmp").exists()


def test_export_names_a_config_that_is_not_the_runs(tmp_path):
    from mshpc.config import Config, dump_yaml
    from mshpc.interop.hf_export import export_hf

    _, folder = _run_with_checkpoint(tmp_path, NEOX_SERIAL)
    other = tmp_path / "other.yaml"
    other.write_text(dump_yaml(Config(model=dataclasses.replace(NEOX_SERIAL, d_model=64))))
    with pytest.raises(InteropError, match=r"model/tok_embeddings.weight is \[97, 32\] but the config's model has "
                                           r"\[97, 64\]; is the config the run's\?"):
        export_hf(folder, tmp_path / "hf", config=other)


@pytest.mark.parametrize("name, arch", [
    ("tiny", "GPTNeoXForCausalLM"), ("gpt-125m", "GPTNeoXForCausalLM"), ("gpt-1.3b", "GPTNeoXForCausalLM"),
    ("gpt-175b", "GPTNeoXForCausalLM"), ("llama3-8b", "LlamaForCausalLM"), ("llama3-70b", "LlamaForCausalLM"),
    (None, "GPTNeoXForCausalLM"),
])
def test_every_shipped_config_and_the_defaults_export_and_keep_checkpoints(name, arch):
    from support.cli_runner import REPO

    from mshpc.config import load_config
    from mshpc.interop.hf_arch import hf_config

    cfg = load_config(REPO / f"configs/{name}.yaml" if name else None)
    assert hf_architecture(cfg.model) == arch
    config = hf_config(cfg.model, "bfloat16")
    if name == "gpt-175b":  # the paper's: LayerNorm + GeLU + the parallel block, as GPT-NeoX's parallel residual
        assert (cfg.model.norm, cfg.model.mlp, config["use_parallel_residual"]) == ("layernorm", "gelu", True)
    assert cfg.checkpoint.interval_steps > 0  # and every run saves at its end
