"""Model FLOPs and MFU (model FLOPs utilisation).

FLOPs per token follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", Sec. 5.1) without activation recomputation, as MFU counts
only the model's own FLOPs (PaLM, App. B):

    F / token = 72 * l * h^2 * (1 + s/(6h) + V/(12*l*h))      for an MLP of width 4h,

written below term by term so that any block works: per layer and token the forward GEMMs cost
2 FLOPs per weight of the block's matrices (`block_matrix_params`: q and out d x d, k and v
d x n_kv_head*head_dim, the MLP 2 matrices d x ffn, or 3 with SwiGLU) and attention 4*s*h (QK^T
and AV, counted over the full s x s matrix as Narayanan does); the logit GEMM costs 2*h*V;
backward doubles each (x3 in all). That is 6 * N + 12 * l * s * h with N the matrices' weights,
lm head included (Kaplan et al. 2020's 6N plus attention). With a sliding window W, each query
meets at most W keys, so s becomes min(W, s) in the attention term.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

from mshpc.config import ModelConfig

# Dense peak TFLOP/s per device and training dtype (vendor datasheets, SXM parts, no sparsity).
PEAK_TFLOPS: dict[tuple[str, str], float] = {
    ("H200", "bf16"): 989.0,
    ("H100", "bf16"): 989.0,
    ("A100", "bf16"): 312.0,
    ("H200", "fp32"): 67.0,
    ("H100", "fp32"): 67.0,
    ("A100", "fp32"): 19.5,
}


def attention_context(m: ModelConfig) -> int:
    """Keys each query attends to in the FLOPs count: the sequence, or the sliding window."""
    return m.seq_len if m.sliding_window is None else min(m.sliding_window, m.seq_len)


def block_matrix_params(m: ModelConfig) -> int:
    """Weights of one block's matrices: q and the output projection (d x d each), k and v
    (d x n_kv_head * head_dim each: grouped-query attention, Ainslie et al. 2023), and the MLP's
    2 (GeLU) or 3 (SwiGLU: gate, up, down; Shazeer 2020) matrices of d x ffn_width."""
    h = m.d_model
    q_width, kv_width = m.n_head * m.head_size, m.kv_heads * m.head_size  # h each, unless head_dim widens them
    mlp_matrices = 3 if m.mlp == "swiglu" else 2
    return 2 * h * q_width + 2 * h * kv_width + mlp_matrices * h * m.ffn_width


def moe_matrix_params(m: ModelConfig, active: bool) -> int:
    """Weights of a mixture-of-experts layer's matrices in place of the MLP: the routed experts
    (3 of d x expert_ffn each, SwiGLU), all E of them or, `active`, the top_k a token passes
    through; the shared experts' 3 of d x shared_ffn and their gate (d x 1); the router (d x E)."""
    assert m.moe is not None
    h, moe = m.d_model, m.moe
    experts = moe.top_k if active else moe.n_experts
    gate = h if moe.shared_expert_gate else 0
    return experts * 3 * h * m.expert_ffn + 3 * h * m.shared_ffn + gate + moe.n_experts * h


def layer_matrix_params(m: ModelConfig, i: int, active: bool = False) -> int:
    """Weights of layer `i`'s matrices (block_matrix_params, or a mixture of experts' in place
    of its MLP: all of them, or those one token meets when `active`)."""
    if not m.is_moe_layer(i):
        return block_matrix_params(m)
    dense_mlp = (3 if m.mlp == "swiglu" else 2) * m.d_model * m.ffn_width
    return block_matrix_params(m) - dense_mlp + moe_matrix_params(m, active)


def model_matrix_params(m: ModelConfig, active: bool = False) -> int:
    """Every layer's matrices (layer_matrix_params summed): dense layers and MoE layers by count."""
    moe = m.moe_layers
    dense = (m.n_layer - moe) * block_matrix_params(m)
    return dense + (moe * layer_matrix_params(m, m.moe.first_dense_layers, active) if m.moe is not None and moe else 0)


def flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs (forward + backward) per token; Narayanan et al. 2021 Eq. in Sec. 5.1. In
    a mixture of experts a token meets only its top_k experts (and the shared ones, and the
    router): only those count (Megatron-Core's num_floating_point_operations does the same)."""
    h, s = m.d_model, attention_context(m)
    gemm = 2 * model_matrix_params(m, active=True)
    attention = 4 * s * m.n_head * m.head_size * m.n_layer  # 4 s h, with h the heads' total width
    logits = 2 * h * m.vocab_size
    return 3.0 * (gemm + attention + logits)


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The table's peak for a device name such as 'NVIDIA H100 80GB HBM3'; None if unknown."""
    for (model, table_dtype), peak in PEAK_TFLOPS.items():
        if model in device_name.upper() and table_dtype == dtype:
            return peak
    return None


def achieved_tflops(tokens_per_s: float, m: ModelConfig, n_devices: int) -> float:
    """Model TFLOP/s each device achieved (known without a peak, so a CPU run has it too)."""
    return tokens_per_s * flops_per_token(m) / (1e12 * n_devices)


def mfu(tokens_per_s: float, m: ModelConfig, n_devices: int, peak: float | None) -> float | None:
    """Achieved model FLOP/s over the peak of all devices; None when the peak is unknown."""
    if peak is None or peak <= 0:
        return None
    return achieved_tflops(tokens_per_s, m, n_devices) / peak


@dataclass(frozen=True)
class MfuDecline:
    step: int
    median_tflops: float  # the rolling median now
    best_tflops: float  # the best rolling median of the run so far
    drop: float  # 1 - median / best


class MfuDeclineDetector:
    """Flags an MFU decline: the rolling median of achieved TFLOP/s over `window_steps` falls
    more than `decline` below the best rolling median of the run (MFU is TFLOP/s over a fixed
    peak, so the two decline alike). One event per decline; it re-arms once the median recovers."""

    def __init__(self, window_steps: int, decline: float) -> None:
        self.decline = decline
        self._window: collections.deque[float] = collections.deque(maxlen=window_steps)
        self.best = 0.0
        self.drop = 0.0  # how far the rolling median is below the best now (0 while not full)
        self._declined = False

    @property
    def declined(self) -> bool:
        """Whether a decline flagged earlier is still on (the median has not recovered)."""
        return self._declined

    def update(self, step: int, tflops: float) -> MfuDecline | None:
        self._window.append(tflops)
        if len(self._window) < (self._window.maxlen or 1):
            return None
        median = statistics.median(self._window)
        self.best = max(self.best, median)
        self.drop = 1 - median / self.best if self.best > 0 else 0.0
        low = median < (1 - self.decline) * self.best
        if low and not self._declined:
            self._declined = True
            return MfuDecline(step, median, self.best, 1 - median / self.best)
        self._declined = low
        return None
