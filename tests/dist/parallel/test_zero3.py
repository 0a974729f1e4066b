"""ZeRO stage 3 (parallel/zero3.py) on gloo ranks, against stage 2 in the same engine.

One spawn of 2 ranks and one of 4 run every case and return numbers; the tests assert on them.
Stage 3 must train bitwise as stage 2 (the same sums in the same order: its buckets are units, cut
elsewhere, and the clipping norm is summed in fp64 so that the cut does not show), hold no more
parameter bytes than its shards plus the two largest units (measured by a hook on each gather and
free, each checked against glibc's own count of bytes in use), and gather one unit ahead.
The layouts with tensor and pipeline parallelism train through the real train step
(train.build_model_step: tp/sp, recomputation, the pipeline schedule, ZeRO, as `mshpc train`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import resource

import pytest
import torch
import torch.distributed as dist
from support.rank_runner import RankError, run_ranks

from mshpc.batch import Batch
from mshpc.config import Config, ModelConfig, MoEConfig, OptimConfig, ParallelConfig, TrainConfig
from mshpc.launch.runtime import Runtime
from mshpc.mesh_shape import MeshShape
from mshpc.model.gpt import GPT, loss_fn
from mshpc.parallel import comm
from mshpc.parallel.apply import apply_activation_checkpointing
from mshpc.parallel.mesh import build_mesh
from mshpc.parallel.zero import ZeroEngine
from mshpc.parallel.zero3 import block_units
from mshpc.parallel.zero_build import build_zero_engine
from mshpc.plan.layout import Layout
from mshpc.plan.memory import zero3_param_bytes
from mshpc.train import build_model_step

TINY = ModelConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)
LLAMA_TINY = dataclasses.replace(TINY, mlp="swiglu", norm="rmsnorm", n_head=4, n_kv_head=2, tie_embeddings=False,
                                 parallel_block=False)
# a mixture of experts with a shared expert: at dp 4 x ep 2 each rank holds 2 of 4 experts,
# sharded over its expert-data-parallel pair, the rest over dp
MOE_TINY = dataclasses.replace(LLAMA_TINY, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=48, n_shared_experts=1))
GPT_125M = ModelConfig(vocab_size=50304, seq_len=16, n_layer=12, n_head=12, d_model=768)
# Llama 3's shape at a size 4 ranks can hold here: untied, grouped-query, SwiGLU, RMSNorm
LLAMA = ModelConfig(vocab_size=32000, seq_len=16, n_layer=4, n_head=8, n_kv_head=2, d_model=512, mlp="swiglu",
                    ffn_dim=1408, norm="rmsnorm", parallel_block=False, tie_embeddings=False)
STEPS = 4
LONG_STEPS = 20  # the dp 2 x tp 2 layout and the adamw case at dp 2
BATCH = 4  # sequences per rank and step
GRAD_CLIP = 0.05  # below these steps' norms: clipping acts, so the norm's rounding would show

# name: (model, optimizer, parallel settings, micro-batches, recomputation); adamw runs LONG_STEPS
CASES = {
    "adamw": (TINY, "adamw", {}, 1, "none"),
    "lamb": (TINY, "lamb", {}, 1, "none"),
    "accumulate": (TINY, "adamw", {}, 2, "none"),
    "full-recompute": (TINY, "adamw", {}, 1, "full"),
    "kept-after-forward": (TINY, "adamw", {"reshard_after_forward": False}, 2, "none"),
    "no-overlap": (TINY, "adamw", {"dp_overlap": False}, 1, "none"),
    "two-blocks-a-unit": (TINY, "adamw", {"zero3_blocks_per_unit": 2}, 1, "selective"),
    "llama-shape": (LLAMA_TINY, "adamw", {}, 1, "none"),
}


def engine_for(model_cfg: ModelConfig, stage: int, group: dist.ProcessGroup | None = None, optim: str = "adamw",
               settings: dict | None = None, recompute: str = "none", cheap: bool = False,
               lr: float = 1e-2) -> ZeroEngine:
    torch.manual_seed(0)
    model = GPT(model_cfg) if not cheap else cheap_model(model_cfg)
    apply_activation_checkpointing(model, recompute)
    settings = settings or {}
    # stage 3's own knobs are refused at stage 2
    mine = {k: v for k, v in settings.items() if stage == 3 or k not in ("zero3_blocks_per_unit", "reshard_after_forward")}
    parallel = ParallelConfig(dp=dist.get_world_size(group), bucket_mb=16 / 1024, zero_stage=stage, **mine)
    blocks = block_units([(int(i), b) for i, b in model.layers.items()], parallel.zero3_blocks_per_unit)
    return build_zero_engine(model, OptimConfig(name=optim, lr=lr, weight_decay=0.1, grad_clip=GRAD_CLIP),
                             parallel, group, blocks=blocks)


def cheap_model(cfg: ModelConfig) -> GPT:
    """A GPT whose weights are a constant: for measuring memory, without drawing a large model's
    weights from a normal distribution (seconds per rank at gpt-125m)."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")  # a parameter per module: the tie is undone
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_embeddings.weight
    for p in model.parameters():
        p.detach().fill_(0.02)
    return model


def tokens_for(cfg: ModelConfig, step: int, rank: int, n: int = BATCH) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1), generator=gen)


def engine_step(engine: ZeroEngine, step: int, micros: int = 1, batch: int = BATCH) -> tuple[float, float]:
    cfg, rank = engine.model.cfg, dist.get_rank(engine.group)
    tokens = tokens_for(cfg, step, rank, batch)
    total = torch.zeros(())
    for i, micro in enumerate(tokens.split(batch // micros)):
        loss = loss_fn(engine.model(micro[:, :-1]), micro[:, 1:]) / micros
        engine.backward(loss, sync=i == micros - 1)
        total += loss.detach()
    comm.all_reduce(total, group=engine.group)
    return total.item(), engine.step(GRAD_CLIP).item()


def weights(engine: ZeroEngine, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every weight, master and moment, whole, assembled from the slices every rank of `group`
    saves (stage 3 holds no weight whole between uses): each rank places its own slices into
    zeros and a sum over the group fills the rest, exactly (x + 0 = x)."""
    slices = {**engine.state_slices(), **engine.weight_slices()}
    shapes = {}
    for mine in comm.all_gather_json({n: list(s.global_shape) for n, s in slices.items()}, group):
        shapes.update(mine)
    offsets, total = {}, 0
    for name in sorted(shapes):
        offsets[name] = total
        total += math.prod(shapes[name])
    flat = torch.zeros(total)
    for name, s in slices.items():
        start = offsets[name] + s.start
        flat[start:start + s.tensor.numel()] = s.tensor.flatten().float()
    comm.all_reduce(flat, group=group)
    return flat


def parity(rank: int, world: int) -> dict:
    out = {}
    for case, (model_cfg, optim, settings, micros, recompute) in CASES.items():
        runs = {}
        for stage in (2, 3):
            engine = engine_for(model_cfg, stage, None, optim, settings, recompute)
            steps = [engine_step(engine, s, micros) for s in range(LONG_STEPS if case == "adamw" else STEPS)]
            engine.wait_params()
            runs[stage] = (steps, weights(engine, engine.group))
        out[case] = {"same_steps": runs[2][0] == runs[3][0], "same_state": torch.equal(runs[2][1], runs[3][1]),
                     "step_diff": max(abs(a - b) / abs(a) for s2, s3 in zip(runs[2][0], runs[3][0], strict=True)
                                      for a, b in zip(s2, s3, strict=True))}
    return out


def traffic(rank: int, world: int) -> dict:
    """Bytes each stage moves per step (the flight recorder's all-gathers and reduce-scatters)."""
    out = {}
    for stage in (2, 3):
        engine = engine_for(TINY, stage)
        engine_step(engine, 0)
        start = comm.RECORDER.snapshot()[-1].seq  # a step records fewer than the recorder keeps
        engine_step(engine, 1)
        out[stage] = sum(r.nbytes for r in comm.RECORDER.snapshot()
                         if r.seq > start and r.op in ("all_gather", "reduce_scatter"))
        engine.wait_params()
    return out


def gather_order(rank: int, world: int) -> dict:
    """How many of the blocks' all-gathers each block's forward and backward found issued when
    its computation began."""
    engine = engine_for(TINY, 3)
    block_bytes = engine.units.unit_bytes(engine.units.uses[1].unit)
    seen: dict[str, list[int]] = {"forward": [], "backward": []}

    def issued() -> int:
        return sum(r.seq > start and r.op == "all_gather" and r.nbytes == block_bytes
                   for r in comm.RECORDER.snapshot())

    def backward_begins(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> None:
        # after the engine's own output hook (registered when it was built)
        out.register_hook(lambda _g: seen["backward"].append(issued()))

    engine_step(engine, 0)
    engine.wait_params()
    for block in engine.model.layers.values():
        block.ln_1.register_forward_pre_hook(lambda *_: seen["forward"].append(issued()))
        block.register_forward_hook(backward_begins)
    start = comm.RECORDER.snapshot()[-1].seq
    engine_step(engine, 1)
    engine.wait_params()
    return seen


def memory_probe(engine: ZeroEngine) -> dict:
    """Peak parameter bytes over one step by the engine's hook, with glibc's bytes in use just
    before and after each allocation and free of a unit's storage."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    events: list[tuple[int, int]] = []

    def watch(_when: str, held: int) -> None:
        info = libc.mallinfo2()
        events.append((held, info.uordblks + info.hblkhd))

    engine.units.watch = watch
    engine_step(engine, 0, batch=1)
    engine.wait_params()
    engine.units.watch = None
    pairs = list(zip(events[::2], events[1::2], strict=True))
    mismatch = max(abs((a1 - a0) - (h1 - h0)) for (h0, a0), (h1, a1) in pairs)
    units = sorted(engine.units.unit_bytes(u) for u in range(len(engine.units.units)))
    return {"peak": max(h for h, _ in events), "full": sum(p.numel() * p.element_size() for p in engine.params),
            "shards": sum(b.master.numel() * b.master.element_size() for b in engine.buckets),
            "buckets": len(engine.buckets), "two_largest": units[-1] + units[-2],
            "changes": len(pairs), "smallest_change": units[0], "allocator_mismatch": mismatch}


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def memory(model_cfg: ModelConfig) -> dict:
    out = memory_probe(engine_for(model_cfg, 3, cheap=True))
    dp = dist.get_world_size()
    out["plan"] = zero3_param_bytes(model_cfg, Layout(dp, 1, 1, 1, 1, 1, "none", zero_stage=3), weight_bytes=4)
    return out


# ---------------------------------------------------------------- through the train step

# name: (model, parallel settings, sequences per micro-batch, micro-batches per step, steps)
LAYOUTS = {
    "dp2-tp2": (TINY, {"dp": 2, "tp": 2}, 4, 1, LONG_STEPS),
    "dp2-pp2": (TINY, {"dp": 2, "pp": 2, "activation_checkpointing": "full"}, 2, 2, STEPS),
    # the experts' units gathered and reduce-scattered over their edp pair, the all-to-alls inside
    "moe-dp4-ep2": (MOE_TINY, {"dp": 4, "ep": 2, "activation_checkpointing": "full"}, 2, 2, STEPS),
}


def train_layout(name: str, stage: int) -> dict:
    model_cfg, settings, micro_batch, micros, steps = LAYOUTS[name]
    cfg = Config(model=model_cfg, parallel=ParallelConfig(bucket_mb=16 / 1024, zero_stage=stage, **settings),
                 optim=OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=GRAD_CLIP),
                 train=TrainConfig(micro_batch=micro_batch, grad_accum=micros))
    p = cfg.parallel
    mesh = build_mesh(MeshShape(pp=p.pp, dp=p.dp, tp=p.tp, ep=p.ep))
    engine, step_fn = build_model_step(cfg, mesh, Runtime(torch.device("cpu"), None, None))
    # buckets over a group other than dp: the experts' domain (edp)
    out: dict = {"steps": [], "domain_buckets": sum(b.group is not engine.group for b in engine.buckets)}
    for step in range(steps):
        loss, norm = step_fn(Batch(tokens_for(model_cfg, step, mesh.coords.dp, micro_batch * micros)))
        out["steps"].append([loss.item(), norm.item()])
    engine.wait_params()
    out["weights"] = weights(engine, None)
    return out


def layouts(rank: int, world: int) -> dict:
    out = {}
    for name in LAYOUTS:
        runs = {stage: train_layout(name, stage) for stage in (2, 3)}
        out[name] = {"same_steps": runs[2]["steps"] == runs[3]["steps"], "steps": len(runs[3]["steps"]),
                     "same_state": torch.equal(runs[2]["weights"], runs[3]["weights"]),
                     "domain_buckets": runs[3]["domain_buckets"]}
    return out


def two_ranks(rank: int, world: int) -> dict:
    return {"parity": parity(rank, world), "traffic": traffic(rank, world), "order": gather_order(rank, world),
            "memory": {"gpt-125m": memory(GPT_125M), "llama": memory(LLAMA)}}


def four_ranks(rank: int, world: int) -> dict:
    return {"layouts": layouts(rank, world), "memory": {"gpt-125m": memory(GPT_125M), "llama": memory(LLAMA)}}


@pytest.fixture(scope="module")
def dp2() -> list[dict]:
    return run_ranks(two_ranks, 2, timeout_s=300)


@pytest.fixture(scope="module")
def dp4() -> list[dict]:
    return run_ranks(four_ranks, 4, timeout_s=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stage3_trains_bitwise_as_stage2_with_tensor_and_pipeline_parallelism(dp4, layout):
    for rank, result in enumerate(dp4):
        r = result["layouts"][layout]
        assert r["steps"] == LAYOUTS[layout][4]
        assert (r["domain_buckets"] > 0) == (LAYOUTS[layout][0].moe is not None), f"rank {rank}: {r}"
        assert r["same_steps"] and r["same_state"], f"rank {rank}: {r}"


@pytest.mark.parametrize("case", list(CASES))
def test_stage3_trains_bitwise_as_stage2(dp2, case):
    for rank, result in enumerate(dp2):
        r = result["parity"][case]
        if case == "lamb":
            # LAMB's per-weight norms are sums over each rank's pieces, which the units cut
            # elsewhere than stage 2's buckets: the same to fp32 rounding, not bitwise
            assert r["step_diff"] < 1e-5, f"rank {rank}"
        else:
            assert r["same_steps"] and r["same_state"], f"rank {rank}: {r}"


def test_stage3_moves_one_and_a_half_times_stage2s_bytes(dp2):
    for result in dp2:
        assert result["traffic"]["3"] == pytest.approx(1.5 * result["traffic"]["2"], rel=0.02)


def test_the_next_units_gather_is_issued_before_this_unit_computes(dp2):
    for result in dp2:
        n = TINY.n_layer
        # block i's forward starts with blocks 0..i+1 gathered or on their way (the last: itself)
        assert result["order"]["forward"] == [min(i + 2, n) for i in range(n)]
        # backward runs blocks n-1..0 after the forward's n gathers: block i starts with n-1..i,
        # and i-1, issued again
        assert result["order"]["backward"] == [n + min(n - i + 1, n) for i in reversed(range(n))]


@pytest.mark.parametrize("model", ["gpt-125m", "llama"])
@pytest.mark.parametrize("world", [2, 4], ids=["dp2", "dp4"])
def test_parameter_bytes_at_peak_are_the_shards_and_two_units(request, model, world):
    for rank, result in enumerate(request.getfixturevalue(f"dp{world}")):
        m = result["memory"][model]
        assert m["changes"] > 0
        # every change the hook counted is one the allocator saw (a few KiB of its own headers)
        assert m["allocator_mismatch"] < min(64 * 1024, m["smallest_change"] / 10), f"rank {rank}"
        # the shards are full/dp but for each bucket's padding to a multiple of dp
        assert m["shards"] <= m["full"] / world + 4 * world * m["buckets"]
        assert m["peak"] <= m["shards"] + m["two_largest"], f"rank {rank}: {m}"
        assert m["peak"] == pytest.approx(m["plan"], rel=0.05), f"rank {rank}: mshpc plan's figure"


# ---------------------------------------------------------------- under a memory cap

# 25M parameters, in units of 3M: at dp 2 stage 2 keeps 14 bytes a parameter (weights, gradients,
# half the masters and moments) and more while it builds; stage 3 about 11 (its shards, its
# moments, the units in flight)
CAPPED = ModelConfig(vocab_size=512, seq_len=16, n_layer=8, n_head=4, d_model=512)
CAP_BYTES_PER_PARAM = 14


def data_bytes() -> int:
    """What RLIMIT_DATA caps: the process's private writable memory (heap and anonymous maps)."""
    status = open("/proc/self/status").read()
    return int(status.split("VmData:")[1].split()[0]) * 1024


def train_capped(rank: int, world: int, stage: int) -> list[float]:
    """Build and train CAPPED under a cap of CAP_BYTES_PER_PARAM per parameter over what this
    rank holds before it starts. Big buffers are mapped and unmapped by malloc (glibc's 1 MiB
    threshold), so that what the cap sees is what is live, not the heap's high-water mark."""
    ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(CAPPED).parameters())
    resource.setrlimit(resource.RLIMIT_DATA, (data_bytes() + CAP_BYTES_PER_PARAM * params, resource.RLIM_INFINITY))
    # stage 2 in private buffers: memory mapped from /dev/shm would escape the cap
    engine = engine_for(CAPPED, stage, settings={"dp_shared_memory": False}, lr=1e-4)
    losses = [engine_step(engine, 0, batch=2)[0] for _ in range(3)]  # one batch again: its loss must fall
    engine.wait_params()
    return losses


def test_a_model_whose_stage2_footprint_exceeds_the_cap_trains_at_stage3_under_it():
    with pytest.raises(RankError, match="can't allocate memory"):
        run_ranks(train_capped, 2, 2, timeout_s=120)
    losses = run_ranks(train_capped, 2, 3, timeout_s=120)[0]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
