"""The CUDA kernels against the pure-torch references on a GPU: the CPU tests' cases
(tests/support/kernel_cases.py) on device "cuda", plus what only a GPU has: the CUDA kernels against
their CPU twins, wide rows, determinism, FlashAttention's sliding window, inductor, and the
model under bf16 autocast. Skipped, with the reason, where no CUDA device is visible."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.kernel_cases import (NORMS, TOL, check_bias_gelu, check_mixed_bias_gelu, check_mixed_norm,
                                  check_moe_permute, check_norm, check_rope, check_swiglu, grads_of, moe_args,
                                  norm_args, rand, swiglu_args)
from mshpc.config import ModelConfig
from mshpc.kernels import build, ops
from mshpc.kernels.ops import mshpc_ops
from mshpc.model.attention import CausalSelfAttention, flash_window_supported
from mshpc.model.gpt import GPT, loss_fn
from mshpc.optim.lamb import Lamb
from mshpc.optim.multi_tensor import FusedAdamW

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"no CUDA device visible (torch {torch.__version__}, CUDA build: {torch.version.cuda})")
DTYPES = list(TOL)


@pytest.fixture(scope="module", autouse=True)
def cuda_kernels() -> None:
    assert build.load().cuda, "with a CUDA device the extension must hold the CUDA kernels"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kind", list(NORMS))
def test_add_norm(kind, residual, dtype):
    check_norm(kind, residual, dtype, device="cuda")
    # rows wider than a block (4100 > 256 threads x 16) and more rows than partial-sum blocks
    check_norm(kind, residual, dtype, device="cuda", d=4100, rows=700)
    # a width of whole 16-byte vectors in fp32 and fp64 but not in 2-byte types: registers at V = 1
    check_norm(kind, residual, dtype, device="cuda", d=100, rows=300)


@pytest.mark.parametrize("kind", list(NORMS))
def test_mixed_dtypes(kind):
    check_mixed_norm(kind, device="cuda")
    check_mixed_bias_gelu(device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bias_gelu(bias, dtype):
    check_bias_gelu(bias, dtype, device="cuda")
    # more rows than partial-sum blocks (fewer than 4 to a block: the 4-row batches' tail), and a
    # width of whole 16-byte vectors in fp32 and fp64 only (2-byte types take the scalar path)
    check_bias_gelu(bias, dtype, device="cuda", shape=(700, 100))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(dtype):
    check_rope(dtype, device="cuda")
    # half a head (6) that is whole 16-byte vectors in fp64 only: the others rotate pair by pair
    check_rope(dtype, device="cuda", head_dim=12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    check_swiglu(dtype, device="cuda")


def test_swiglu_cuda_matches_cpu_twin():
    """Thousands of thread blocks and a gate width (1400) that the block size does not divide,
    so rows start mid-block: the CUDA kernel equals its CPU twin."""
    x_cpu = swiglu_args(torch.float32, grad=True, shape=(3000, 2 * 1400))
    x_gpu = x_cpu.detach().cuda().requires_grad_(True)
    torch.testing.assert_close(ops.swiglu(x_gpu).cpu(), ops.swiglu(x_cpu), **TOL[torch.float32])
    torch.testing.assert_close(grads_of(ops.swiglu, (x_gpu,))[0].cpu(), grads_of(ops.swiglu, (x_cpu,))[0],
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_permute(dtype):
    check_moe_permute(dtype, device="cuda")
    # rows of whole 16-byte vectors (64 columns), and rows wider than a block (4100 > 256 x 16)
    check_moe_permute(dtype, device="cuda", tokens=300, k=2, d=64, drop=50)
    check_moe_permute(dtype, device="cuda", tokens=40, k=4, d=4100, drop=7)


def test_moe_unpermute_cuda_matches_cpu_twin_and_is_deterministic():
    """Sums over a token's copies and the weights' dot products in one fixed order: the CUDA
    kernel gives the same bits twice, and its CPU twin's values."""
    x, pos, w, rows = moe_args(torch.float32, tokens=2000, k=2, d=1000, drop=100)
    y = rand(rows, 1000, dtype=torch.float32, seed=3, grad=True)
    w.requires_grad_(True)
    on_gpu = (y.detach().cuda().requires_grad_(True), w.detach().cuda().requires_grad_(True))
    fn_cpu = lambda a, b: ops.moe_unpermute(a, pos, b)  # noqa: E731
    fn_gpu = lambda a, b: ops.moe_unpermute(a, pos.cuda(), b)  # noqa: E731
    torch.testing.assert_close(fn_gpu(*on_gpu).cpu(), fn_cpu(y, w), **TOL[torch.float32])
    first, second = grads_of(fn_gpu, on_gpu), grads_of(fn_gpu, on_gpu)
    for a, b, c in zip(first, second, grads_of(fn_cpu, (y, w)), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.cpu(), c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", list(NORMS))
def test_cuda_kernels_match_cpu_twins_and_are_deterministic(kind):
    fused = NORMS[kind][0]
    on_cpu = norm_args(kind, torch.float32, True, grad=True, d=1000, rows=300)
    on_gpu = norm_args(kind, torch.float32, True, grad=True, d=1000, rows=300, device="cuda")
    torch.testing.assert_close(fused(*on_gpu)[0].cpu(), fused(*on_cpu)[0], **TOL[torch.float32])
    first, second = grads_of(fused, on_gpu), grads_of(fused, on_gpu)
    for a, b, c in zip(first, second, grads_of(fused, on_cpu)):
        assert torch.equal(a, b)  # partial sums in fixed blocks, summed in a fixed order
        torch.testing.assert_close(a.cpu(), c, rtol=1e-4, atol=1e-4)


def test_multi_tensor_adamw_and_lamb_on_cuda():
    sizes = (7, 65536, 66537, 1, 200_000)
    ours = [rand(n, dtype=torch.float32, seed=i, device="cuda") for i, n in enumerate(sizes)]
    theirs = [p.clone() for p in ours]
    fused = FusedAdamW(ours, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    torch_adamw = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    for step in range(3):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            a.grad = rand(a.numel(), dtype=torch.float32, seed=100 * step + i, device="cuda")
            b.grad = a.grad.clone()
        fused.step()
        torch_adamw.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    lamb = Lamb([p.clone() for p in ours], lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
    grads = [rand(p.numel(), dtype=torch.float32, seed=7 + i, device="cuda") for i, p in enumerate(ours)]
    directions = []
    for q, g in zip(lamb.param_groups[0]["params"], grads):
        q.grad = g.clone()
        directions.append(lamb._direction(q, lamb.param_groups[0]))
    work = [g.clone() for g in grads]
    zeros = [torch.zeros_like(p) for p in ours]
    norms_sq = mshpc_ops.multi_tensor_lamb_direction(ours, work, zeros, [z.clone() for z in zeros],
                                                     [0.0] * len(ours), 0.9, 0.95, 1e-6, 1)
    for got, want in zip(work, directions):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want = torch.stack([torch.stack([p.square().sum() for p in ours]), torch.stack([r.square().sum() for r in directions])])
    torch.testing.assert_close(norms_sq.T, want, rtol=5e-5, atol=0)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_flash_window_attention_matches_the_masked_path(n_kv_head):
    cfg = ModelConfig(seq_len=256, n_head=4, d_model=256, sliding_window=48, n_kv_head=n_kv_head)
    attn = CausalSelfAttention(cfg).cuda()
    q = rand(2, 256, 4, 64, dtype=torch.bfloat16, seed=0, device="cuda")
    # grouped-query: flash gets k and v expanded, the mask path SDPA's enable_gqa
    k, v = (rand(2, 256, n_kv_head, 64, dtype=torch.bfloat16, seed=i, device="cuda") for i in (1, 2))
    assert flash_window_supported(q, 0.0)[0]
    flash = attn.attend(q, k, v, 0.0)
    masked = attn.attend(q.float(), k.float(), v.float(), 0.0)  # fp32: the SDPA mask path
    assert not flash_window_supported(q.float(), 0.0)[0]
    torch.testing.assert_close(flash.float(), masked, rtol=2e-2, atol=2e-2)


def test_inductor_compiles_the_fused_ops():
    x, r, w, b, eps = norm_args("layer", torch.bfloat16, True, grad=True, device="cuda")

    def block(x, r, w, b):
        h, s = ops.add_layer_norm(x, r, w, b, eps)
        return ops.bias_gelu(h, b) + s

    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(x, r, w, b), block(x, r, w, b))
    for got, want in zip(grads_of(compiled, (x, r, w, b)), grads_of(block, (x, r, w, b))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window", [None, 5])
def test_model_under_bf16_autocast(window):
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, norm="layernorm",
                      mlp_bias=True, sliding_window=window)
    results = []
    for mode in ("on", "off"):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(cfg, fused_kernels=mode)).cuda()
        batch = torch.randint(0, 64, (4, 17), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_on, grads_on), (loss_off, grads_off) = results
    torch.testing.assert_close(loss_on, loss_off, rtol=2e-2, atol=2e-3)
    for a, b in zip(grads_on, grads_off):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
