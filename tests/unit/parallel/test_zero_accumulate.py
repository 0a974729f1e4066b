"""How the ZeRO engine accumulates gradients into its fp32 buckets (parallel/zero.py `_on_grad`):
the step's first micro-batch is copied in, later ones added, nothing zeroed between steps. One
rank over a real one-member gloo group, against plain autograd on a copy of the same module."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mshpc.config import OptimConfig, ParallelConfig
from mshpc.parallel.zero import ZeroEngine
from mshpc.parallel.zero_build import build_zero_engine


class TwoPaths(nn.Module):
    """A linear stack whose `extra` layer only some steps use."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.extra = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.extra(h)) if use_extra else h)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def engine_for(model: nn.Module, overlap: bool = True) -> ZeroEngine:
    # 256 B buckets: several buckets, so parameters of one step land in different ones
    parallel = ParallelConfig(dp=1, dp_overlap=overlap, bucket_mb=256 / 2**20)
    return build_zero_engine(model, OptimConfig(name="adamw", lr=1e-2), parallel)


def micro_batches(step: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(3, 8, generator=gen) for _ in range(n)]


def bucket_grads(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return {names[id(p)]: view.clone() for p, view in zip(engine.params, engine.grad_views, strict=True)}


def plain_copy(engine: ZeroEngine) -> TwoPaths:
    """The engine's model as it now is, without the engine's hooks."""
    engine.wait_params()
    ref = TwoPaths().to(next(engine.model.parameters()).dtype)
    ref.load_state_dict(engine.model.state_dict())
    return ref


def reference_grads(engine: ZeroEngine, micros: list[torch.Tensor], use_extra: bool) -> dict[str, torch.Tensor]:
    """Plain autograd's accumulated .grad over `micros`, on a copy of the engine's model."""
    ref = plain_copy(engine)
    for x in micros:
        ref(x, use_extra).sum().backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}


def accumulate(engine: ZeroEngine, micros: list[torch.Tensor], use_extra: bool = True) -> None:
    dtype = next(engine.model.parameters()).dtype
    for i, x in enumerate(micros):
        engine.backward(engine.model(x.to(dtype), use_extra).sum(), sync=i == len(micros) - 1)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("n_micro", [1, 3])
def test_each_step_holds_the_sum_of_its_own_micro_batches(one_rank, overlap, n_micro):
    torch.manual_seed(0)
    engine = engine_for(TwoPaths(), overlap)
    assert len(engine.buckets) > 1
    for step in range(3):  # a second and third step would show the first's gradients added in
        micros = micro_batches(step, n_micro)
        want = reference_grads(engine, micros, use_extra=True)
        accumulate(engine, micros)
        got = bucket_grads(engine)
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, msg=f"step {step}: {name}")
        # autograd handed its gradient over: nothing left behind in .grad to add into next time
        assert all(p.grad is None for p in engine.model.parameters())
        engine.step()
    engine.wait_params()


def test_a_parameter_no_micro_batch_reaches_gets_zero_not_last_steps_gradient(one_rank):
    torch.manual_seed(0)
    engine = engine_for(TwoPaths())
    accumulate(engine, micro_batches(0, 2), use_extra=True)
    assert bucket_grads(engine)["extra.weight"].abs().sum() > 0
    engine.step()
    micros = micro_batches(1, 2)
    want = reference_grads(engine, micros, use_extra=False)
    accumulate(engine, micros, use_extra=False)
    got = bucket_grads(engine)
    assert torch.count_nonzero(got["extra.weight"]) == 0 and torch.count_nonzero(got["extra.bias"]) == 0
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=name)
    engine.step()
    engine.wait_params()


def test_bf16_parameters_accumulate_their_gradients_in_fp32(one_rank):
    torch.manual_seed(0)
    engine = engine_for(TwoPaths().to(torch.bfloat16))
    for step in range(2):
        micros = micro_batches(step, 3)
        accumulate(engine, micros)
        got = bucket_grads(engine)
        # the fp32 sum of each micro-batch's bf16 gradient: what a bf16 .grad accumulation would round
        want: dict[str, torch.Tensor] = {}
        for x in micros:
            ref = plain_copy(engine)
            ref(x.to(torch.bfloat16)).sum().backward()
            for n, p in ref.named_parameters():
                want[n] = want.get(n, 0) + p.grad.float()
        for name, grad in want.items():
            assert got[name].dtype == torch.float32
            torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-6, msg=f"step {step}: {name}")
        engine.step()
    engine.wait_params()
