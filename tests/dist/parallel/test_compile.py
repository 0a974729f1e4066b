"""train.compile on 2 gloo ranks: each block compiled by torch.compile (inductor, through the
fused CPU custom operators) trains and validates like the eager engine, through the real train
step and evaluator (train.build_model_step, evaluate.build_evaluator): at dp=2 (one graph that
both blocks share, fullgraph), at tp=2 (the collectives run eagerly between graphs; with full
recomputation too, the checkpoint then wrapping the compiled block), at pp=2
with full recomputation (checkpointed blocks compiled, the pipeline's stages fed by its sends), at
ZeRO stage 3 with two micro-batches (each block's gathers and frees hook it from outside its
graph, which stays fullgraph; another micro-batch shape, so that it compiles again), and a
mixture of experts, whose blocks compile only their attention half (the router, dispatch and
experts eager): at ep=2 with full recomputation (the micro-batch cut into overlapped slices; the
load statistics counted once although each block runs forward twice) and at tp=2.

Validation runs after the first step and again after the third: under no_grad and eval mode a
block compiles once more (one inference graph, shared by the blocks), and neither the return to
training nor the second validation compiles anything: no recompile storm.

One spawn runs every layout, eager then compiled, so the ranks pay torch's start-up once and
later compiles find the first's caches: 37 s for dp and tp alone with a cold inductor cache on a
quiet 2-core machine, 15 s warm, 96-122 s while seven other test runs shared the machine;
the pp=2 layout and the two validations added 29 CPU-s with a cold cache (97 CPU-s for the
file against 68, both ranks, measured one after the other at a load average of 40-50).
The MoE layouts compile 1 graph at ep=2 (6 when the whole block was compiled) and 12 at tp=2
(its collectives break the attention half), 5 s per rank with a warm cache.
Tolerance: inductor fuses and reorders the blocks' elementwise work and reductions (rounding
differs, fp32), so losses agree to rel 1e-5 and parameters to 1e-5 after 3 steps, as the other
parity tests allow for reordered sums."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support.rank_runner import run_ranks
from support.token_data import make_random_dataset

from mshpc.config import Config, DataConfig, EvalConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig, TrainConfig
from mshpc.data.prepare import val_dataset_path
from mshpc.data.sampler import SequenceSampler
from mshpc.data.shards import TokenDataset
from mshpc.data.window_reader import WindowReader
from mshpc.evaluate import build_evaluator
from mshpc.launch.runtime import Runtime
from mshpc.model.moe import MoE
from mshpc.mesh_shape import MeshShape
from mshpc.parallel.compile_blocks import compile_seconds
from mshpc.parallel.mesh import build_mesh
from mshpc.train import build_model_step

# the smallest shape with the parts that matter: rmsnorm, parallel block, rope, 2 heads per tp
# rank, 2 layers per pipeline stage; the byte tokenizer's vocabulary
TINY = ModelConfig(vocab_size=257, seq_len=16, n_layer=4, n_head=4, d_model=32, parallel_block=True,
                   norm="rmsnorm")
TINY_MOE = dataclasses.replace(TINY, mlp="swiglu", parallel_block=False,
                               moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32))
GLOBAL_BATCH = 4
STEPS = 3
EVAL_AFTER = (1, 3)  # steps done when validation runs: once at the start, once after training on

# name: (parallel config, sequences per micro-batch, micro-batches per step)
LAYOUTS = {
    "dp2": (ParallelConfig(dp=2, bucket_mb=8 / 1024), 2, 1),
    "tp2": (ParallelConfig(tp=2, dp=1, bucket_mb=8 / 1024), 4, 1),
    "pp2-full-recompute": (ParallelConfig(pp=2, dp=1, activation_checkpointing="full"), 2, 2),
    "dp2-zero3": (ParallelConfig(dp=2, bucket_mb=8 / 1024, zero_stage=3), 1, 2),
    "tp2-full-recompute": (ParallelConfig(tp=2, dp=1, activation_checkpointing="full", bucket_mb=8 / 1024), 4, 1),
    "moe-ep2-full-recompute": (ParallelConfig(dp=2, ep=2, activation_checkpointing="full", bucket_mb=8 / 1024), 2, 1),
    "moe-tp2": (ParallelConfig(tp=2, dp=1, bucket_mb=8 / 1024), 4, 1),
}
# tp2's block code again, checkpointed: dynamo would reuse tp2's graphs unseen; forget them first
FRESH = ("tp2-full-recompute",)
VALIDATED = ("dp2", "pp2-full-recompute")  # pp=1 scores the whole model, pp=2 through the stages


def config(layout: str, data: str, compile: bool) -> Config:
    parallel, micro_batch, grad_accum = LAYOUTS[layout]
    model = TINY_MOE if layout.startswith("moe") else TINY
    return Config(model=model, parallel=parallel, data=DataConfig(path=data),
                  optim=OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0, eps=1e-6),
                  train=TrainConfig(micro_batch=micro_batch, grad_accum=grad_accum, compile=compile),
                  eval=EvalConfig(interval_steps=2, batches=2))


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def train(layout: str, data: str, compile: bool) -> dict:
    """STEPS steps through the real train step, validated after each of EVAL_AFTER."""
    cfg = config(layout, data, compile)
    if compile and layout in FRESH:
        torch._dynamo.reset()
    mesh = build_mesh(MeshShape(pp=cfg.parallel.pp, dp=cfg.parallel.dp, tp=cfg.parallel.tp, ep=cfg.parallel.ep))
    engine, step_fn = build_model_step(cfg, mesh, Runtime(torch.device("cpu"), None, None))
    dataset = TokenDataset.open(Path(data))
    reader = WindowReader(dataset, SequenceSampler(dataset.n_tokens, TINY.seq_len, cfg.global_batch, 0),
                          cfg.parallel.dp, None)
    evaluator = build_evaluator(mesh, engine, TokenDataset.open(val_dataset_path(cfg.data)), torch.device("cpu"),
                                None, eval_cfg=cfg.eval, model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train,
                                data=cfg.data)
    out: dict = {"losses": [], "val": [], "graphs": []}
    start = graphs(), compile_seconds()
    for step in range(STEPS):
        loss, _ = step_fn(reader.batch(step, mesh.coords.dp))
        out["losses"].append(loss.item())
        out["graphs"].append(graphs() - start[0])  # after each step's forward and backward
        if layout in VALIDATED and step + 1 in EVAL_AFTER:
            out["val"].append(evaluator.evaluate())
            out["graphs"].append(graphs() - start[0])
    engine.wait_params()
    out["compile_s"] = compile_seconds() - start[1]
    # the fp32 masters this rank steps (at ZeRO stage 3 no weight is whole between uses)
    out["params"] = [s.tensor.clone() for n, s in sorted(engine.state_slices().items()) if n.startswith("master/")]
    # token copies each MoE layer counted on this rank over the steps (nothing reads them here)
    out["moe_copies"] = [m.stats[: m.moe.n_experts].sum().item() for m in engine.model.modules() if isinstance(m, MoE)]
    evaluator.close()
    dataset.close()
    return out


def layouts(rank: int, world: int, data: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        eager, compiled = train(layout, data, compile=False), train(layout, data, compile=True)
        eager_params, compiled_params = eager.pop("params"), compiled.pop("params")
        compiled["param_diff"] = max((p - q).abs().max().item()
                                     for p, q in zip(eager_params, compiled_params, strict=True))
        out[layout] = {"eager": eager, "compiled": compiled}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    data = make_random_dataset(tmp_path_factory.mktemp("compile-data"), val_fraction=0.3)
    return run_ranks(layouts, 2, str(data), timeout_s=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_blocks_train_like_eager(ranks, layout):
    for r in ranks:
        eager, compiled = r[layout]["eager"], r[layout]["compiled"]
        assert eager["graphs"][-1] == 0 and compiled["graphs"][0] >= 1 and compiled["compile_s"] > 0, \
            "the blocks must really be compiled, and only when asked"
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
        assert compiled["param_diff"] < 1e-5
        if layout.startswith("moe"):
            # a rank's share of the tokens x top_k, per layer (under tp: its sequence shard's)
            copies = STEPS * GLOBAL_BATCH // 2 * TINY.seq_len * 2
            assert eager["moe_copies"] == compiled["moe_copies"] == [copies] * 4
        else:
            assert eager["moe_copies"] == compiled["moe_copies"] == []


def test_moe_blocks_compile_their_attention_half_in_one_graph(ranks):
    # regional compilation: one graph that every MoE block's attention half shares, with the
    # ep-overlapped slices and the recomputation; the router, dispatch and experts run eagerly
    for r in ranks:
        assert r["moe-ep2-full-recompute"]["compiled"]["graphs"] == [1] * STEPS


@pytest.mark.parametrize("layout", VALIDATED)
def test_validation_under_compile_matches_eager_and_compiles_once(ranks, layout):
    for r in ranks:
        eager, compiled = r[layout]["eager"], r[layout]["compiled"]
        assert len(compiled["val"]) == len(EVAL_AFTER)
        assert compiled["val"] == pytest.approx(eager["val"], rel=1e-5)
        # graphs after: step 1, validation, step 2, step 3, validation
        first_step, first_eval, *rest = compiled["graphs"]
        assert first_step == 1, "identical blocks share one training graph"
        assert first_eval == 2, "validation compiles one inference graph for every block"
        assert rest == [2, 2, 2], "nothing recompiles afterwards, in training or validation"
