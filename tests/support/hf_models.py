"""Shared by the Hugging Face export/import tests: tiny mshpc models of each exportable kind, and
the logits of an mshpc model and of a transformers model on the same tokens."""

import warnings
from pathlib import Path

import torch

from mshpc.config import Config, ModelConfig, dump_yaml
from support.ckpt_runs import sharded_checkpoint

# max |a - b| / max |b| over all logits: fp32 on both sides, same math in another order
MAX_RELATIVE_DIFF = 1e-5

TINY = dict(vocab_size=97, seq_len=32, n_layer=2, n_head=4, d_model=32, fused_kernels="off")
NEOX_SERIAL = ModelConfig(**TINY, norm="layernorm", mlp="gelu", parallel_block=False, tie_embeddings=False)
NEOX_PARALLEL = ModelConfig(**TINY, norm="layernorm", mlp="gelu", parallel_block=True)
LLAMA_GQA = ModelConfig(**TINY, norm="rmsnorm", mlp="swiglu", n_kv_head=2, ffn_dim=48, tie_embeddings=False,
                        rope_theta=500000.0, norm_eps=1e-6)
LLAMA_MQA_TIED = ModelConfig(**TINY, norm="rmsnorm", mlp="swiglu", n_kv_head=1)
# Qwen2/2.5: q, k, v biases, tied (its small models), RoPE base 1e6
QWEN2 = ModelConfig(**TINY, norm="rmsnorm", mlp="swiglu", n_kv_head=2, ffn_dim=48, qkv_bias=True, rope_theta=1e6,
                    norm_eps=1e-6)
MISTRAL = ModelConfig(**TINY, norm="rmsnorm", mlp="swiglu", n_kv_head=2, ffn_dim=48, sliding_window=8,
                      tie_embeddings=False)
# Llama 3.1's rope scaling, its bands scaled down to these 32 positions: head dim 8 at base
# 500000 has wavelengths 6.3, 167, 4440 and 118,000 positions; against 16 original ones, the
# first is in the blended band (4 to 16), the others above it
LLAMA31 = ModelConfig(**TINY, norm="rmsnorm", mlp="swiglu", n_kv_head=2, ffn_dim=48, tie_embeddings=False,
                      rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0, rope_original_seq_len=16)
LLAMA32 = ModelConfig(**{**LLAMA31.__dict__, "rope_factor": 32.0, "tie_embeddings": True})  # 3.2: factor 32, tied


def tokens(m: ModelConfig, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, m.vocab_size, (batch, m.seq_len), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: Path, idx: torch.Tensor) -> torch.Tensor:
    """Logits of the transformers model `from_pretrained(hf_dir)` loads (the class its config.json names)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()  # no dtype: 4.x and 5.x name it differently
    assert next(model.parameters()).dtype == torch.float32  # the comparison is fp32 against fp32
    with torch.no_grad():
        return model(idx).logits.float()


def mshpc_logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(idx).float()


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max())


FAST = ["train.cpu_threads=1", "run.progress=lines", "supervisor.max_restarts=0", "checkpoint.async_save=false",
        "data.loader=torch"]  # as cli_runner.SMALL: DALI's import would cost more than the steps


def checkpoint_logits(run_dir: Path, idx: torch.Tensor) -> torch.Tensor:
    """The logits of the whole model in the run's latest checkpoint (its model/ copy, joined)."""
    from mshpc.checkpoint.model_copy import read_model_copy
    from mshpc.interop.hf_export import check_shapes, find_checkpoint, run_config
    from mshpc.model.gpt import GPT

    run_dir, cfg = run_config(run_dir, None)
    folder = find_checkpoint(run_dir, run_dir, cfg.checkpoint)
    weights = check_shapes(read_model_copy(folder), cfg.model, folder)
    model = GPT(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return mshpc_logits(model, idx)


def run_tokens(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))


def checkpoint_run(run_dir: Path, cfg: Config, model: torch.nn.Module) -> Path:
    """A run directory (config.yaml) whose one checkpoint, `latest`, holds `model`'s weights as
    its model/ copy, each weight whole in one of 2 shards as dp=2 ranks write it; the step folder."""
    folder = run_dir / "checkpoints/step-0000003"
    folder.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    whole = {f"model/{n}": (p.detach().clone(), i % 2) for i, (n, p) in enumerate(model.named_parameters())}
    sharded_checkpoint(folder, {}, n_shards=2, whole=whole)
    (run_dir / "checkpoints/latest").symlink_to(folder.name)
    return folder
