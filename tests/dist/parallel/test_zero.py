"""The ZeRO-2 engine on 1, 2 and 4 gloo ranks against single-rank, unsharded training.

Each rank count is one spawn (module fixtures) that runs every case and returns numbers; the
tests assert on them. Every rank also trains the unsharded reference itself on the whole global
batch, so nothing but JSON crosses process boundaries.
"""

from __future__ import annotations

import math

import pytest
import torch

from mshpc.config import ModelConfig, OptimConfig, ParallelConfig
from mshpc.model.gpt import GPT, loss_fn
from mshpc.parallel import comm
from mshpc.parallel.zero import ZeroEngine
from mshpc.parallel.zero_build import build_zero_engine
from support.rank_runner import run_ranks
from support.single_rank import train_single_rank

# RMSNorm, as when these tolerances were set: with LayerNorm (the default since #42) the
# parameters differ from the single rank's by up to 1.4e-5 after 3 AdamW steps (fp32's reduction
# order, which Adam's normalised update scales up where gradients are near zero).
TINY = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, norm="rmsnorm")
BUCKET_MB = 16 / 1024  # 16 KiB: 10 buckets for this model, so there is something to overlap
GLOBAL_BATCH = 8  # sequences per step at every dp and accumulation
STEPS = 3
GRAD_CLIP = 0.05  # below the gradient norm of these steps: clipping is active in every case
CASES = [(name, overlap, accum) for name in ("adamw", "lamb") for overlap in (True, False) for accum in (1, 2)]


def optim_cfg(name: str) -> OptimConfig:
    return OptimConfig(name=name, lr=1e-2, weight_decay=0.1, grad_clip=GRAD_CLIP)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, TINY.seq_len + 1),
                         generator=torch.Generator().manual_seed(100 + step))


def reference(name: str, steps: int) -> tuple[GPT, torch.optim.Optimizer, list[float], list[float]]:
    """Single-rank training on the whole global batch: torch's clipping, the unsharded optimizer."""
    return train_single_rank(TINY, optim_cfg(name), batch, steps)


def engine_for(name: str, overlap: bool, world: int, seed: int = 0) -> ZeroEngine:
    torch.manual_seed(seed)
    parallel = ParallelConfig(dp=world, dp_overlap=overlap, bucket_mb=BUCKET_MB)
    return build_zero_engine(GPT(TINY), optim_cfg(name), parallel)


def engine_step(engine: ZeroEngine, step: int, accum: int, rank: int, world: int) -> tuple[float, float]:
    per_rank = GLOBAL_BATCH // world
    local = batch(step)[rank * per_rank:(rank + 1) * per_rank]
    micros = local.split(per_rank // accum)
    loss_sum = torch.zeros(())
    for i, micro in enumerate(micros):
        loss = loss_fn(engine.model(micro[:, :-1]), micro[:, 1:]) / accum
        engine.backward(loss, sync=i == len(micros) - 1)
        loss_sum += loss.detach()
    comm.all_reduce(loss_sum)
    norm = engine.step(GRAD_CLIP)
    return loss_sum.item() / world, norm.item()


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def parity(rank: int, world: int) -> dict:
    out = {}
    refs = {name: reference(name, STEPS) for name in ("adamw", "lamb")}
    for name, overlap, accum in CASES:
        engine = engine_for(name, overlap, world)
        steps = [engine_step(engine, s, accum, rank, world) for s in range(STEPS)]
        engine.wait_params()
        ref_model, _, ref_losses, ref_norms = refs[name]
        out[f"{name}-{overlap}-{accum}"] = {
            "losses": [s[0] for s in steps], "norms": [s[1] for s in steps],
            "ref_losses": ref_losses, "ref_norms": ref_norms,
            "param_diff": max_param_diff(engine.model, ref_model)}
    return out


def memory(rank: int, world: int) -> dict:
    engine = engine_for("adamw", True, world)
    engine_step(engine, 0, 1, rank, world)
    model, optimizer, _, _ = reference("adamw", 1)
    state = [v for s in optimizer.state.values() for v in s.values()] + list(model.parameters())
    unsharded = sum(t.numel() * t.element_size() for t in state)  # fp32 params are the masters
    return {"sharded": engine.optimizer_state_bytes(), "unsharded": unsharded}


def overlap_seen(rank: int, world: int) -> dict:
    """How many reduce-scatters had started when backward reached the embedding (its last
    layer), and how many buckets' all-gathers were still unwaited when layer 0 began."""
    out = {}
    for overlap in (True, False):
        engine = engine_for("adamw", overlap, world)
        model, seen = engine.model, {}

        def count_reduces(_: torch.Tensor) -> None:
            seen["reduces"] = sum(r.op == "reduce_scatter" for r in comm.RECORDER.snapshot()) - before

        engine_step(engine, 0, 1, rank, world)  # the first forward has nothing to wait for
        def watch_embedding_grad(_m: torch.nn.Module, _i: tuple, y: torch.Tensor) -> None:
            y.register_hook(count_reduces)  # the embedding's output grad: backward's last layer

        model.tok_embeddings.register_forward_hook(watch_embedding_grad)
        model.layers["0"].register_forward_pre_hook(lambda m, i: seen.update(unwaited=len(engine._gathering)))
        before = sum(r.op == "reduce_scatter" for r in comm.RECORDER.snapshot())
        engine_step(engine, 1, 1, rank, world)
        out[str(overlap)] = {"buckets": len(engine.buckets), **seen}
    return out


def bf16_params(rank: int, world: int) -> dict:
    """A bf16 model: gradients still accumulate (over micro-batches) and reduce in fp32."""
    torch.manual_seed(0)
    engine = build_zero_engine(GPT(TINY).to(torch.bfloat16), optim_cfg("adamw"),
                               ParallelConfig(dp=world, bucket_mb=BUCKET_MB))
    losses = [engine_step(engine, s, 2, rank, world)[0] for s in range(STEPS)]
    engine.wait_params()
    return {"losses": losses, "ref_losses": reference("adamw", STEPS)[2],
            "fp32": all(b.grads.dtype == b.master.dtype == torch.float32 for b in engine.buckets),
            "bf16": all(p.dtype == torch.bfloat16 for p in engine.model.parameters())}


# ---------------------------------------------------------------- checkpoint round trip


def gather_global(slices_per_rank: list[dict]) -> dict[str, dict]:
    """The in-memory "checkpoint": every named global tensor assembled from all ranks' slices,
    with how many slices covered each element (each must be covered exactly once)."""
    out: dict[str, dict] = {}
    for slices in slices_per_rank:
        for name, s in slices.items():
            entry = out.setdefault(name, {"shape": s["shape"], "data": [0.0] * math.prod(s["shape"]),
                                          "cover": [0] * math.prod(s["shape"])})
            for k, value in enumerate(s["data"]):
                entry["data"][s["start"] + k] = value
                entry["cover"][s["start"] + k] += 1
    return out


def slices_json(engine: ZeroEngine) -> dict:
    return {name: {"shape": list(s.global_shape), "start": s.start, "data": s.tensor.flatten().tolist()}
            for name, s in engine.state_slices().items()}


def reader_of(checkpoint: dict[str, dict]):
    tensors = {name: torch.tensor(e["data"]) for name, e in checkpoint.items()}
    return lambda name, start, numel: tensors[name][start:start + numel]


def resume_and_continue(rank: int, world: int, checkpoint: dict) -> dict:
    """Load a checkpoint into an engine initialised differently, train 2 more steps."""
    engine = engine_for("adamw", True, world, seed=1)
    engine.load_state_slices(reader_of(checkpoint))
    steps = [engine_step(engine, s, 1, rank, world) for s in (2, 3)]
    engine.wait_params()
    ref_model, _, ref_losses, _ = reference("adamw", 4)
    return {"losses": [s[0] for s in steps], "ref_losses": ref_losses[2:],
            "param_diff": max_param_diff(engine.model, ref_model)}


def save_and_reload(rank: int, world: int) -> dict:
    """Train 2 steps and take this rank's slices; load them all back into a fresh engine at the
    same dp: identical slices and parameters, and the next steps match the original's."""
    engine = engine_for("adamw", True, world)
    for s in range(2):
        engine_step(engine, s, 1, rank, world)
    engine.wait_params()
    mine = slices_json(engine)
    checkpoint = gather_global(comm.all_gather_json(mine))
    fresh = engine_for("adamw", True, world, seed=1)
    fresh.load_state_slices(reader_of(checkpoint))
    same = slices_json(fresh) == mine and max_param_diff(fresh.model, engine.model) == 0.0
    nexts = [(engine_step(engine, 2, 1, rank, world), engine_step(fresh, 2, 1, rank, world))]
    return {"same": same, "next_equal": nexts[0][0] == nexts[0][1], "checkpoint": checkpoint if rank == 0 else None}


def update_hooks(rank: int, world: int) -> dict:
    """A checkpoint's stage 1 reads the state until the engine next writes it: a hook given to
    before_next_update runs once, in the next step, before the masters, moments and weights
    change; a load runs it too."""
    engine = engine_for("adamw", True, world)
    engine_step(engine, 0, 1, rank, world)
    engine.wait_params()
    weight = next(engine.model.parameters())
    state = [engine.pieces[0].tensor, engine.optimizer.state[engine.pieces[0].tensor]["exp_avg"], weight]
    before = [t.clone() for t in state]
    seen: list[list[torch.Tensor]] = []
    engine.before_next_update(lambda: seen.append([t.clone() for t in state]))
    forward_only = engine.model(batch(1)[:1, :-1])  # the next step's reads do not run it
    runs_before_step = len(seen)
    for step in (1, 2):
        engine_step(engine, step, 1, rank, world)
    engine.wait_params()
    changed = all(not torch.equal(a, b) for a, b in zip(state, before))
    loaded: list[int] = []
    engine.before_next_update(lambda: loaded.append(1))
    engine.load_state_slices(lambda name, start, numel: torch.zeros(numel))
    return {"runs_before_step": runs_before_step, "runs": len(seen), "finite": bool(forward_only.isfinite().all()),
            "saw_old_state": all(torch.equal(a, b) for a, b in zip(seen[0], before)),
            "state_changed": changed, "load_runs": len(loaded)}


def dp_cases(rank: int, world: int, checkpoint: dict | None) -> dict:
    out = {"parity": parity(rank, world), "memory": memory(rank, world),
           "overlap": overlap_seen(rank, world)}
    if world == 2:
        out["save"] = save_and_reload(rank, world)
        out["bf16"] = bf16_params(rank, world)
        out["hooks"] = update_hooks(rank, world)
    if checkpoint is not None:
        out["resume"] = resume_and_continue(rank, world, checkpoint)
    return out


@pytest.fixture(scope="module")
def dp2() -> list[dict]:
    return run_ranks(dp_cases, 2, None, timeout_s=120)


@pytest.fixture(scope="module")
def dp2_checkpoint(dp2) -> dict:
    return dp2[0]["save"]["checkpoint"]


@pytest.fixture(scope="module")
def dp4(dp2_checkpoint) -> list[dict]:
    return run_ranks(dp_cases, 4, dp2_checkpoint, timeout_s=180)


@pytest.fixture(scope="module")
def dp1(dp2_checkpoint) -> list[dict]:
    return run_ranks(resume_and_continue, 1, dp2_checkpoint, timeout_s=60)


@pytest.fixture(params=[2, 4], ids=["dp2", "dp4"])
def ranks(request, dp2) -> list[dict]:
    return dp2 if request.param == 2 else request.getfixturevalue("dp4")


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("name,overlap,accum", CASES, ids=[f"{n}-{'overlap' if o else 'no_overlap'}-accum{a}" for n, o, a in CASES])
def test_matches_single_rank_training_with_the_same_global_batch(ranks, name, overlap, accum):
    for rank, result in enumerate(ranks):
        case = result["parity"][f"{name}-{overlap}-{accum}"]
        assert case["losses"] == pytest.approx(case["ref_losses"], rel=1e-5), f"rank {rank}"
        assert case["param_diff"] < 1e-5, f"rank {rank}"


def test_clipping_uses_the_global_norm_of_the_unsharded_gradients(ranks):
    for result in ranks:
        for case in result["parity"].values():
            assert min(case["ref_norms"]) > GRAD_CLIP  # clipping really acted
            assert case["norms"] == pytest.approx(case["ref_norms"], rel=1e-5)


def test_optimizer_memory_per_rank_is_one_dp_th(ranks):
    world = len(ranks)
    for result in ranks:
        m = result["memory"]
        assert m["sharded"] <= (1 / world + 0.05) * m["unsharded"], m


def test_reduce_scatter_overlaps_backward_and_gather_overlaps_forward(ranks):
    for result in ranks:
        on, off = result["overlap"]["True"], result["overlap"]["False"]
        assert on["buckets"] >= 4
        # with overlap, most buckets were already reducing while backward was still running
        assert on["reduces"] >= on["buckets"] - 2 and off["reduces"] == 0
        # with overlap, layer 0 started while later layers' buckets were still gathering
        assert on["unwaited"] >= on["buckets"] - 2 and off["unwaited"] == 0


def test_state_slices_round_trip_at_the_same_dp(dp2):
    for result in dp2:
        assert result["save"]["same"] and result["save"]["next_equal"]
    # every element of every global tensor is held by exactly one rank
    for name, entry in dp2[0]["save"]["checkpoint"].items():
        assert set(entry["cover"]) == {1}, name
    names = set(dp2[0]["save"]["checkpoint"])
    assert "optim.step" in names and "master/layers.0.attn.qkv.weight" in names
    assert "optim.exp_avg/layers.0.attn.qkv.weight" in names and "optim.exp_avg_sq/tok_embeddings.weight" in names


@pytest.mark.parametrize("target", ["dp1", "dp4"])
def test_dp2_checkpoint_continues_at_another_dp_as_if_uninterrupted(request, target):
    for result in request.getfixturevalue(target):
        resume = result["resume"] if target == "dp4" else result
        assert resume["losses"] == pytest.approx(resume["ref_losses"], rel=1e-5)
        assert resume["param_diff"] < 1e-5


def test_bf16_parameters_train_with_fp32_gradients_and_masters(dp2):
    for result in dp2:
        bf16 = result["bf16"]
        assert bf16["fp32"] and bf16["bf16"]
        assert bf16["losses"] == pytest.approx(bf16["ref_losses"], rel=2e-2)  # bf16 compute


def test_an_update_hook_runs_once_before_the_state_changes(dp2):
    for result in dp2:
        hooks = result["hooks"]
        assert hooks["runs_before_step"] == 0 and hooks["finite"]
        assert hooks["runs"] == 1 and hooks["saw_old_state"] and hooks["state_changed"]
        assert hooks["load_runs"] == 1
