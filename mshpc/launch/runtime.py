"""Where and in what precision a rank computes: decided once at start-up from train.device and
train.dtype, with this rank's share of the host's cores on CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mshpc.config import TrainConfig
from mshpc.diagnose.mfu import peak_tflops
from mshpc.errors import ConfigError
from mshpc.launch.rendezvous import DistInfo


@dataclass(frozen=True)
class Runtime:
    """Where and in what precision this rank computes, decided once at start-up."""

    device: torch.device
    autocast_dtype: torch.dtype | None  # None: plain fp32
    peak_tflops: float | None


def uses_cuda(cfg: TrainConfig) -> bool:
    """Whether this rank computes on its GPU (train.device); a ConfigError when asked to and none is seen."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA device is visible (choose 'auto' or 'cpu')")
    return use_cuda


def uses_bf16(cfg: TrainConfig, use_cuda: bool) -> bool:
    return cfg.dtype == "bf16" or (cfg.dtype == "auto" and use_cuda)


def build_runtime(cfg: TrainConfig, info: DistInfo) -> Runtime:
    use_cuda = uses_cuda(cfg)
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
        device, name = torch.device("cuda", info.local_rank), torch.cuda.get_device_name()
    else:
        # Ranks on one host share its cores; oversubscribing threads slows every rank.
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(cfg.cpu_threads or max(1, cores // info.local_world_size))
        device, name = torch.device("cpu"), "cpu"
    bf16 = uses_bf16(cfg, use_cuda)
    peak = cfg.peak_tflops if cfg.peak_tflops is not None else peak_tflops(name, "bf16" if bf16 else "fp32")
    return Runtime(device=device, autocast_dtype=torch.bfloat16 if bf16 else None, peak_tflops=peak)


def max_memory_gib(rt: Runtime) -> float | None:
    """The most device memory this rank's tensors have held so far (None on CPU)."""
    return torch.cuda.max_memory_allocated(rt.device) / 2**30 if rt.device.type == "cuda" else None
