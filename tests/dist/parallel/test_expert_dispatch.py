"""Expert parallelism's dispatch on 2 gloo ranks against the layer with every expert local: the
same outputs and gradients, each rank's input its own, through each way the all-to-alls run:
whole exchanges (no overlap), token chunks inside the layer (a micro-batch of one sequence), and
a MoE block's micro-batch cut into slices (DeepSeek-V3's dual micro-batch), with shared experts,
dropless and with a capacity that drops copies. A slice is routed alone, so its capacity is the
slice's: there the reference runs the block slice by slice, without the router's losses (they are
the whole micro-batch's, as the dropless slices case checks). An expert's gradient on its ep rank
is the sum of what every rank's tokens routed to it give."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from mshpc.config import ModelConfig, MoEConfig, ParallelConfig
from mshpc.mesh_shape import MeshShape
from mshpc.model.gpt import GPT
from mshpc.parallel.expert_parallel import apply_ep
from mshpc.parallel.mesh import build_mesh
from support.rank_runner import run_ranks

MOE = MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=24, n_shared_experts=1, experts_impl="loop")
MODEL = ModelConfig(vocab_size=32, seq_len=16, n_layer=1, n_head=2, d_model=16, mlp="swiglu", moe=MOE)
CASES = {  # name: (ep_overlap, ep_overlap_chunks, sequences per micro-batch, capacity_factor)
    "whole": (False, 1, 4, 1.0),
    "token_chunks": (True, 3, 1, 1.0),
    "micro_batch_slices": (True, 2, 4, None),
    "micro_batch_slices_capacity": (True, 2, 4, 1.0),
}


def block_and_grads(model: GPT, x: torch.Tensor, slices: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The block's output on x run as `slices` separate calls, and the gradients of a weighted sum of it."""
    block = model.layers["0"]
    x = x.clone().requires_grad_()
    out = torch.cat([block(xi) for xi in x.chunk(slices)])
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return out.detach(), {"x": x.grad, **grads}


def compare(rank: int, world: int) -> dict:
    mesh = build_mesh(MeshShape(pp=1, dp=world, tp=1, ep=world))
    out = {}
    for name, (overlap, chunks, batch, capacity) in CASES.items():
        sliced = chunks if overlap and batch >= chunks and capacity is not None else 1
        aux = MOE.aux_loss_coef if sliced == 1 else 0.0
        model_cfg = dataclasses.replace(MODEL, moe=dataclasses.replace(MOE, capacity_factor=capacity, aux_loss_coef=aux))
        x = torch.randn(batch, MODEL.seq_len, MODEL.d_model, generator=torch.Generator().manual_seed(10 + rank))
        torch.manual_seed(0)
        whole = GPT(model_cfg).double()
        torch.manual_seed(0)
        split = GPT(model_cfg).double()
        parallel = ParallelConfig(dp=world, ep=world, ep_overlap=overlap, ep_overlap_chunks=chunks)
        apply_ep(split, mesh, parallel, batch)
        want, want_grads = block_and_grads(whole, x.double(), sliced)
        got, got_grads = block_and_grads(split, x.double())
        local = slice(rank * 2, rank * 2 + 2)  # this rank's experts of the 4
        diffs = {"out": (got - want).abs().max().item()}
        for key, g in got_grads.items():
            w = want_grads[key]
            if "experts." in key:  # every ep rank's tokens routed to this rank's experts
                dist.all_reduce(w)
                w = w[local]
            diffs[key] = (g - w).abs().max().item()
        out[name] = diffs
        out[f"{name}_experts_shape"] = list(split.layers["0"].mlp.experts.fc.shape)
        out[f"{name}_dropped"] = int(split.layers["0"].mlp.stats[MOE.n_experts].item())
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(compare, 2, timeout_s=120)


@pytest.mark.parametrize("case", list(CASES))
def test_each_way_of_dispatching_equals_every_expert_local(results, case):
    for rank, r in enumerate(results):
        assert r[f"{case}_experts_shape"] == [2, 48, 16], rank
        assert (r[f"{case}_dropped"] > 0) == (CASES[case][3] is not None), (rank, case)  # capacity really drops
        for key, diff in r[case].items():
            assert diff < 1e-12, (rank, case, key, diff)
