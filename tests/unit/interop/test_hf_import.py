"""Hugging Face -> mshpc: `mshpc import` writes a config whose model, started from the folder's
weights (train.init_from), computes transformers' logits; what mshpc cannot compute is refused."""

import json
import warnings

import pytest
import torch
from support.hf_models import MAX_RELATIVE_DIFF, checkpoint_run, hf_logits, mshpc_logits, relative_diff
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from mshpc.config import load_config
from mshpc.errors import InteropError
from mshpc.interop.hf_import import import_config, initial_model

SHAPE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=32)


def _save(hf_model, path, same_norms=False, mlp_biases=False):
    """Perturb the norms (and, if asked, the MLP biases) off 1 and 0 so that a misplaced one
    shows, then save_pretrained into `path` (safetensors)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name or "_proj.bias" in name or (mlp_biases and ".mlp." in name and name.endswith("bias")):
                p.add_(torch.randn_like(p) * 0.1)
        if same_norms:  # a parallel block has one norm in mshpc: both of NeoX's the same
            for layer in hf_model.gpt_neox.layers:
                layer.post_attention_layernorm.load_state_dict(layer.input_layernorm.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model.save_pretrained(path)
    return path


def neox(parallel, **extra):
    return GPTNeoXForCausalLM(GPTNeoXConfig(**SHAPE, hidden_act="gelu_pytorch_tanh", rotary_pct=1.0,
                                            use_parallel_residual=parallel, **extra))


def llama(**extra):
    return LlamaForCausalLM(LlamaConfig(**SHAPE, num_key_value_heads=2, rope_theta=500000.0, **extra))


def qwen2(**extra):
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True,
                                        **extra))


def mistral(**extra):
    return MistralForCausalLM(MistralConfig(**SHAPE, num_key_value_heads=2, sliding_window=8, **extra))


# Llama 3.1's and 3.2's rope scaling, bands scaled to these 32 positions (support/hf_models.LLAMA31)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _imported_logits(tmp_path, hf_dir, idx):
    cfg = import_config(hf_dir, tmp_path / "imported.yaml")
    reloaded = load_config(tmp_path / "imported.yaml")
    assert reloaded == cfg and reloaded.train.init_from == str(hf_dir.resolve())
    return cfg, mshpc_logits(initial_model(reloaded.model, reloaded.train.init_from), idx)


@pytest.mark.parametrize("make, parallel, mlp_biases", [
    (lambda: neox(False), False, False), (lambda: neox(True), True, False),
    (lambda: neox(False), False, True), (lambda: llama(), False, False),
    (lambda: llama(tie_word_embeddings=True), False, False),
], ids=["neox-serial", "neox-parallel", "neox-mlp-biases", "llama-gqa", "llama-tied"])
def test_imported_model_computes_transformers_logits(tmp_path, make, parallel, mlp_biases):
    hf_dir = _save(make(), tmp_path / "hf", same_norms=parallel, mlp_biases=mlp_biases)
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    cfg, got = _imported_logits(tmp_path, hf_dir, idx)
    assert cfg.model.parallel_block is parallel and cfg.model.mlp_bias is mlp_biases
    assert cfg.checkpoint.interval_steps == 500  # an imported config keeps checkpoints, as the defaults do
    assert relative_diff(got, hf_logits(hf_dir, idx)) <= MAX_RELATIVE_DIFF


@pytest.mark.parametrize("make, expect", [
    (lambda: qwen2(), dict(qkv_bias=True, tie_embeddings=True, rope_theta=1e6, sliding_window=None)),
    (lambda: qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=0), dict(qkv_bias=True, sliding_window=8)),
    (lambda: mistral(), dict(sliding_window=8, qkv_bias=False)),
    (lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)),
     dict(rope_scaling="llama3", rope_factor=8.0, rope_original_seq_len=16, rope_theta=500000.0)),
    (lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True,
                                          rope_parameters={**LLAMA3_ROPE, "factor": 32.0})),
     dict(rope_scaling="llama3", rope_factor=32.0)),
], ids=["qwen2", "qwen2-window", "mistral-window", "llama3.1-rope-scaling", "llama3.2-rope-scaling"])
def test_imported_qwen2_mistral_and_llama3_scaling_compute_transformers_logits(tmp_path, make, expect):
    hf_dir = _save(make(), tmp_path / "hf")
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    cfg, got = _imported_logits(tmp_path, hf_dir, idx)
    assert {k: getattr(cfg.model, k) for k in expect} == expect
    assert relative_diff(got, hf_logits(hf_dir, idx)) <= MAX_RELATIVE_DIFF


def test_import_refuses_a_qwen2_window_on_some_layers_only(tmp_path):
    hf_dir = _save(qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=1), tmp_path / "hf")
    with pytest.raises(InteropError, match="a sliding window on layers 1 to 1 only is not implemented in mshpc"):
        import_config(hf_dir, tmp_path / "out.yaml")


def _config_json(hf_dir, **changes):
    data = json.loads((hf_dir / "config.json").read_text())
    data.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["GPT2LMHeadModel"]),
     "architecture 'GPT2LMHeadModel' is not supported (choose LlamaForCausalLM or MistralForCausalLM or "
     "Qwen2ForCausalLM or GPTNeoXForCausalLM or MixtralForCausalLM or Qwen2MoeForCausalLM or Qwen3MoeForCausalLM)"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}),
     "rope scaling 'yarn' is not implemented in mshpc (choose rope_type 'default' or 'llama3')"),
    (dict(hidden_act="relu"), "hidden_act='relu' is not implemented in mshpc"),
    (dict(hidden_size="32"), "config.json's hidden_size='32' is not a whole number from 1 to 1099511627776"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}, rope_parameters=None),
     "rope scaling 'linear' is not implemented in mshpc"),
])
def test_import_refuses_what_mshpc_does_not_compute(tmp_path, changes, message):
    hf_dir = _save(llama(), tmp_path / "hf")
    _config_json(hf_dir, **changes)
    with pytest.raises(InteropError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        import_config(hf_dir, tmp_path / "out.yaml")
    assert "\n" not in str(err.value) and not (tmp_path / "out.yaml").exists()


def test_import_refuses_partial_rotary_and_attention_biases(tmp_path):
    pythia_like = _save(GPTNeoXForCausalLM(GPTNeoXConfig(**SHAPE, hidden_act="gelu_pytorch_tanh")), tmp_path / "p")
    with pytest.raises(InteropError, match="rotary on 0.25 of each head is not implemented"):
        import_config(pythia_like, tmp_path / "out.yaml")
    model = neox(False)
    with torch.no_grad():
        model.gpt_neox.layers[1].attention.dense.bias.fill_(0.5)
    biased = _save(model, tmp_path / "b")
    cfg = import_config(biased, tmp_path / "out.yaml")
    with pytest.raises(InteropError, match=r"gpt_neox.layers.1.attention.dense.bias is not zero, and mshpc's "
                                           "attention output projection has no bias"):
        initial_model(cfg.model, cfg.train.init_from)


def test_import_reads_no_pickle(tmp_path):
    hf_dir = _save(llama(), tmp_path / "hf")
    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
    with pytest.raises(InteropError, match="pytorch_model.bin is pickled: mshpc does not load pickles"):
        import_config(hf_dir, tmp_path / "out.yaml")


def test_init_from_refuses_a_config_of_another_model(tmp_path):
    hf_dir = _save(llama(), tmp_path / "hf")
    import_config(hf_dir, tmp_path / "out.yaml")
    cfg = load_config(tmp_path / "out.yaml", ["model.d_model=64", "model.seq_len=16"])
    with pytest.raises(InteropError, match="config.json gives d_model=32 but the config has model.d_model=64"):
        initial_model(cfg.model, cfg.train.init_from)
    shorter = load_config(tmp_path / "out.yaml", ["model.seq_len=16"])  # seq_len is the run's to choose
    written = load_config(tmp_path / "out.yaml")
    assert torch.equal(initial_model(shorter.model, shorter.train.init_from).tok_embeddings.weight,
                       initial_model(written.model, written.train.init_from).tok_embeddings.weight)


def test_cli_import_then_export_round_trips(tmp_path, capsys):
    """`mshpc import` and `mshpc export` as a user types them (in this process), end to end."""
    from mshpc.cli import main

    hf_dir = _save(llama(), tmp_path / "hf")
    assert main(["import", str(hf_dir), "--out", str(tmp_path / "llama.yaml")]) == 0
    assert "train.init_from: " + str(hf_dir.resolve()) in capsys.readouterr().out
    cfg = load_config(tmp_path / "llama.yaml")
    checkpoint_run(tmp_path / "run", cfg, initial_model(cfg.model, cfg.train.init_from))
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out"), "--max-shard-mb", "0.05"]) == 0
    assert "as LlamaForCausalLM" in capsys.readouterr().out
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    assert relative_diff(hf_logits(tmp_path / "out", idx), hf_logits(hf_dir, idx)) <= MAX_RELATIVE_DIFF
