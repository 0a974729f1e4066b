"""ZeRO shard domains (parallel/zero.py `ShardDomain`): parameters sharded over a group of their
own. Four gloo ranks, dp 4 with "experts" carved out of it as an MoE does (expert parallelism 2):
ranks 0 and 2 hold expert 0, ranks 1 and 3 expert 1, and each expert is sharded over its pair,
the expert-data-parallel group. The reference is one process holding both experts, each dp
rank's batch routed through its rank's expert.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from support.rank_runner import run_ranks
from torch import nn

from mshpc.config import OptimConfig, ParallelConfig
from mshpc.optim.optimizer import build_optimizer
from mshpc.parallel import comm
from mshpc.parallel.zero import ShardDomain, ZeroEngine
from mshpc.parallel.zero_build import build_zero_engine

DP, EP = 4, 2
PER_RANK = 2  # samples per dp rank and step
STEPS = 3
GRAD_CLIP = 0.05  # below these steps' gradient norms: clipping acts
EXPERT = ("expert.weight", "expert.bias")


class Toy(nn.Module):
    """Shared input and output layers around one expert, this rank's."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(8, 16)
        self.expert = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, expert: nn.Module | None = None) -> torch.Tensor:
        expert = self.expert if expert is None else expert
        return self.out(torch.tanh(expert(torch.tanh(self.inp(x)))))


class Reference(nn.Module):
    """Every expert in one process: the shared layers of seed 0, expert e of seed e (what each
    domain group's first rank, rank e, starts from)."""

    def __init__(self) -> None:
        super().__init__()
        self.toy = Toy(0)
        self.experts = nn.ModuleList([Toy(e).expert for e in range(EP)])
        del self.toy.expert

    def loss(self, step: int) -> torch.Tensor:
        # the mean over the global batch: every dp rank's mean, averaged
        return sum(local_loss(self.toy, step, r, self.experts[r % EP]) for r in range(DP)) / DP


def local_loss(model: nn.Module, step: int, rank: int, expert: nn.Module | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(PER_RANK, 8, generator=gen), torch.randn(PER_RANK, 4, generator=gen)
    return nn.functional.mse_loss(model(x, expert), y)


def optim_cfg(name: str) -> OptimConfig:
    return OptimConfig(name=name, lr=1e-2, weight_decay=0.1, grad_clip=GRAD_CLIP)


def train_reference(name: str, steps: int) -> tuple[Reference, list[float], list[float]]:
    ref = Reference()
    optimizer = build_optimizer(ref, optim_cfg(name))
    losses, norms = [], []
    for step in range(steps):
        loss = ref.loss(step)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), GRAD_CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return ref, losses, norms


def expert_domain(rank: int) -> ShardDomain:
    # every rank creates both groups, in one order; its own is the ranks holding its expert
    groups = [dist.new_group([e + k * EP for k in range(DP // EP)]) for e in range(EP)]
    e = rank % EP
    placement = {"expert.weight": ((EP, 16, 16), e * 256), "expert.bias": ((EP, 16), e * 16)}
    return ShardDomain(frozenset(EXPERT), groups[e], placement)


def engine_for(name: str, rank: int, domain: ShardDomain, shared: bool, seed: int | None = None,
               stage: int = 2) -> ZeroEngine:
    # each rank draws its own weights: the engine must start every parameter from its group's first rank
    parallel = ParallelConfig(dp=DP, bucket_mb=256 / 2**20, dp_shared_memory=shared, zero_stage=stage)
    return build_zero_engine(Toy(rank if seed is None else seed), optim_cfg(name), parallel, domains=(domain,))


def engine_step(engine: ZeroEngine, step: int, rank: int) -> tuple[float, float]:
    loss = local_loss(engine.model, step, rank)
    engine.backward(loss)
    total = loss.detach().clone()
    comm.all_reduce(total)
    return total.item() / DP, engine.step(GRAD_CLIP).item()


def whole_tensors(engine: ZeroEngine) -> dict[str, dict]:
    """Every rank's checkpoint slices, assembled: each global tensor's values and how many
    slices covered each element."""
    mine = {n: [list(s.global_shape), s.start, s.tensor.flatten().tolist()] for n, s in engine.state_slices().items()}
    out: dict[str, dict] = {}
    for slices in comm.all_gather_json(mine):
        for name, (shape, start, data) in slices.items():
            entry = out.setdefault(name, {"shape": shape, "data": [0.0] * math.prod(shape),
                                          "cover": [0] * math.prod(shape)})
            for k, value in enumerate(data):
                entry["data"][start + k] = value
                entry["cover"][start + k] += 1
    return out


def ref_tensors(ref: Reference) -> dict[str, torch.Tensor]:
    out = {n.removeprefix("toy."): p.detach() for n, p in ref.named_parameters() if not n.startswith("experts")}
    for suffix in ("weight", "bias"):
        out[f"expert.{suffix}"] = torch.stack([getattr(e, suffix).detach() for e in ref.experts])
    return out


def case(rank: int, name: str, shared: bool, stage: int = 2) -> dict:
    domain = expert_domain(rank)
    engine = engine_for(name, rank, domain, shared, stage=stage)
    mixed = [b for b in engine.buckets if 0 < len(bucket_names(engine, b) & set(EXPERT)) < len(b.layout.slots)]
    own_group = all(b.group is domain.group for b in engine.buckets if bucket_names(engine, b) & set(EXPERT))
    steps = [engine_step(engine, s, rank) for s in range(STEPS)]
    engine.wait_params()
    ref, ref_losses, ref_norms = train_reference(name, STEPS + 1)
    ref_after, _, _ = train_reference(name, STEPS)
    whole = whole_tensors(engine)
    want = ref_tensors(ref_after)
    # resume: a fresh engine drawn from other weights loads the assembled checkpoint, and the
    # next step is the reference's
    fresh = engine_for(name, rank, domain, shared, seed=7 + rank, stage=stage)
    tensors = {n: torch.tensor(e["data"]) for n, e in whole.items()}
    fresh.load_state_slices(lambda n, start, numel: tensors[n][start:start + numel])
    resumed_loss, _ = engine_step(fresh, STEPS, rank)
    fresh.wait_params()
    return {
        "mixed_buckets": len(mixed), "own_group": own_group, "shared": engine.shared,
        "losses": [s[0] for s in steps], "norms": [s[1] for s in steps],
        "ref_losses": ref_losses[:STEPS], "ref_norms": ref_norms[:STEPS],
        "master_diff": max((torch.tensor(whole[f"master/{n}"]["data"]).view(w.shape) - w).abs().max().item()
                           for n, w in want.items()),
        "shapes": {n: whole[f"master/{n}"]["shape"] for n in EXPERT},
        "covered_once": all(set(e["cover"]) == {1} for e in whole.values()),
        "expert_diff": (engine.model.expert.weight.detach() - ref_after.experts[rank % EP].weight.detach()).abs().max().item(),
        "resumed_loss": resumed_loss, "ref_resumed_loss": ref_losses[STEPS],
    }


def bucket_names(engine: ZeroEngine, bucket) -> set[str]:
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return {names[id(engine.params[slot.index])] for slot in bucket.layout.slots}


def domains(rank: int, world: int) -> dict:
    # stage 3: the toy has no blocks, so it is one unit, whose experts gather over their own group
    return {"adamw": case(rank, "adamw", shared=True), "lamb": case(rank, "lamb", shared=False),
            "stage3": case(rank, "adamw", shared=False, stage=3)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(domains, DP, timeout_s=120)


@pytest.mark.parametrize("name", ["adamw", "lamb", "stage3"])
def test_experts_sharded_over_their_own_group_train_as_one_process(ranks, name):
    for rank, result in enumerate(ranks):
        r = result[name]
        assert r["mixed_buckets"] == 0 and r["own_group"], f"rank {rank}: a bucket mixes domains"
        assert r["shared"] == (name == "adamw")  # both bucket paths: shared memory and point-to-point
        assert min(r["ref_norms"]) > GRAD_CLIP  # clipping acted
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), f"rank {rank}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), f"rank {rank}"
        assert r["expert_diff"] < 1e-5, f"rank {rank}: its own expert"


@pytest.mark.parametrize("name", ["adamw", "lamb", "stage3"])
def test_checkpoint_holds_every_expert_by_global_index_once_and_resumes(ranks, name):
    for rank, result in enumerate(ranks):
        r = result[name]
        assert r["shapes"] == {"expert.weight": [EP, 16, 16], "expert.bias": [EP, 16]}
        assert r["covered_once"] and r["master_diff"] < 1e-5, f"rank {rank}"
        assert r["resumed_loss"] == pytest.approx(r["ref_resumed_loss"], rel=1e-5), f"rank {rank}"

