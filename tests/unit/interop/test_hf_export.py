"""mshpc -> Hugging Face: the exported folder loads in transformers and computes mshpc's logits."""

import dataclasses
import json

import pytest
import torch
from support.hf_models import (
    LLAMA_GQA,
    LLAMA_MQA_TIED,
    MAX_RELATIVE_DIFF,
    NEOX_PARALLEL,
    NEOX_SERIAL,
    hf_logits,
    mshpc_logits,
    relative_diff,
    tokens,
)

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
], ids=["neox-serial-untied", "neox-parallel-tied", "neox-mlp-bias", "llama-gqa-untied", "llama-mqa-tied"])
def test_exported_model_computes_mshpc_logits(tmp_path, m, arch):
    model = _drawn(m)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    write_hf(tmp_path / "hf", m, weights, "byte")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["architectures"] == [arch]
    idx = tokens(m)
    assert relative_diff(hf_logits(tmp_path / "hf", idx), mshpc_logits(model, idx)) <= MAX_RELATIVE_DIFF


def test_export_shards_above_the_size_and_writes_an_index(tmp_path):
    model = _drawn(NEOX_SERIAL)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    files = write_hf(tmp_path / "hf", NEOX_SERIAL, weights, "byte", max_shard_bytes=20_000)[0]
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and "model-00001-of-" in files
    assert not (tmp_path / "hf/model.safetensors").exists()
    idx = tokens(NEOX_SERIAL)
    assert relative_diff(hf_logits(tmp_path / "hf", idx), mshpc_logits(model, idx)) <= MAX_RELATIVE_DIFF


def test_byte_tokenizer_exports_the_ids_mshpc_trains_on(tmp_path):
    from transformers import AutoTokenizer

    from mshpc.data.tokenizer import ByteTokenizer

    model = _drawn(NEOX_PARALLEL)
    write_hf(tmp_path / "hf", NEOX_PARALLEL, {n: p.detach() for n, p in model.named_parameters()}, "byte")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return x ** 2  # héllo, wörld ✓"
    assert tok(text)["input_ids"] == ByteTokenizer().encode(text.encode()).tolist()
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


def test_export_refuses_a_sliding_window_and_a_used_folder(tmp_path):
    with pytest.raises(InteropError, match="sliding_window=8"):
        hf_architecture(dataclasses.replace(NEOX_SERIAL, sliding_window=8))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/keep.txt").write_text("mine")
    model = GPT(NEOX_SERIAL)
    with pytest.raises(InteropError, match="not an empty folder"):
        write_hf(tmp_path / "hf", NEOX_SERIAL, {n: p.detach() for n, p in model.named_parameters()}, "byte")
    assert (tmp_path / "hf/keep.txt").read_text() == "mine"


def test_cli_export_of_an_unsupported_model_stops_with_one_line(tmp_path, capsys):
    from support.cli_runner import REPO

    from mshpc.cli import USER_ERROR_EXIT, main

    (tmp_path / "run").mkdir()  # tiny.yaml: rmsnorm + gelu + parallel block, no checkpoint needed to say so
    (tmp_path / "run/config.yaml").write_text((REPO / "configs/tiny.yaml").read_text())
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == USER_ERROR_EXIT
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("mshpc: error: InteropError: model.norm=rmsnorm, model.mlp=gelu, model.parallel_block=true "
                       "has no transformers equivalent (nearest supported: layernorm + gelu + parallel block -> "
                       "GPTNeoXForCausalLM)")
    assert not (tmp_path / "out").exists()
