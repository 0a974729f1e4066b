"""Which operators a compiled block runs (train.compile with model.fused_kernels), and the key."""

import pytest
import torch

from mshpc.config import load_config
from mshpc.errors import ConfigError
from mshpc.kernels.dispatch import FUSED, REFERENCE
from mshpc.parallel.compile_blocks import compile_kernels


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
