"""Which operators a compiled block runs (train.compile with model.fused_kernels), which part of
a block is compiled, and the key."""

import pytest
import torch

from mshpc.config import load_config
from mshpc.errors import ConfigError
from mshpc.kernels.dispatch import FUSED, REFERENCE, Kernels
from mshpc.model.gpt import GPT
from mshpc.parallel.compile_blocks import apply_compile, compile_kernels


def test_auto_on_cuda_hands_inductor_the_references():
    # inductor's fusion of the references beat mshpc's CUDA kernels 1.8-4.5x on the H200
    assert compile_kernels("auto", torch.device("cuda"), FUSED) is REFERENCE


@pytest.mark.parametrize("mode, device", [("on", "cuda"), ("auto", "cpu"), ("on", "cpu")])
def test_fused_kernels_stay_where_asked_or_faster(mode, device):
    assert compile_kernels(mode, torch.device(device), FUSED) is FUSED


def test_off_or_unbuilt_kernels_stay_references():
    assert compile_kernels("auto", torch.device("cuda"), REFERENCE) is REFERENCE
    assert compile_kernels("off", torch.device("cpu"), REFERENCE) is REFERENCE


def test_train_compile_is_a_typed_key():
    assert load_config(None, ["train.compile=true"]).train.compile is True
    assert load_config(None).train.compile is False
    with pytest.raises(ConfigError):
        load_config(None, ["train.compile=fast"])


def test_a_moe_block_compiles_its_attention_half_and_keeps_its_experts_kernels():
    # regional compilation (docs/moe.md): the dense block whole; the MoE block's attention half
    # only, its router, dispatch and experts eager with the kernels chosen for eager runs
    cfg = load_config("configs/tiny-moe.yaml", ["model.n_layer=2", "model.moe.first_dense_layers=1"]).model
    model = GPT(cfg)
    for module in model.modules():
        if isinstance(getattr(module, "kernels", None), Kernels):
            module.kernels = FUSED  # as where the fused CUDA kernels built
    dense, moe = model.layers.values()
    apply_compile(model.layers.values(), "auto", torch.device("cuda"), fullgraph=True)  # traces nothing yet
    assert hasattr(dense.forward, "_torchdynamo_orig_callable")
    assert hasattr(moe.attention_half, "_torchdynamo_orig_callable")
    assert not hasattr(moe.forward, "_torchdynamo_orig_callable")
    assert all(m.kernels is REFERENCE for m in (dense.ln_1, dense.attn, dense.mlp, moe.ln_1, moe.attn, moe.ln_2))
    assert moe.mlp.kernels is FUSED and moe.mlp.experts.kernels is FUSED
