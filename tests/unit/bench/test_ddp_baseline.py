"""The DDP step benchmarks hold mshpc against (mshpc.bench.ddp_baseline) is the plain PyTorch loop:
on one gloo rank it trains exactly as forward, backward, clip_grad_norm_ and the optimizer's step
written out by hand, in fp32 and under bf16 autocast."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from mshpc.bench.ddp_baseline import ddp_train_step
from mshpc.config import ModelConfig, OptimConfig, ParallelConfig
from mshpc.model.gpt import GPT, loss_fn
from mshpc.optim.optimizer import build_optimizer


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_ddp_step_is_the_hand_written_training_step(one_rank, autocast):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16, fused_kernels="off"))
    by_hand, start = copy.deepcopy(model), copy.deepcopy(model)
    optim = OptimConfig(lr=1e-2, grad_clip=0.5)
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    x, y = batch[:, :-1], batch[:, 1:]
    step, finish = ddp_train_step(model, x, y, parallel=ParallelConfig(dp=1), optim=optim, autocast=autocast)
    opt = build_optimizer(by_hand, optim)
    for _ in range(2):
        step()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = loss_fn(by_hand(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(by_hand.parameters(), optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    finish()
    want, before = dict(by_hand.named_parameters()), dict(start.named_parameters())
    for name, param in model.named_parameters():
        assert torch.allclose(param, want[name], rtol=1e-6, atol=1e-7), name
        assert not torch.equal(param, before[name]), f"{name} did not train"
        assert param.grad is None, name  # each step ends with the gradients freed, as the loop does
