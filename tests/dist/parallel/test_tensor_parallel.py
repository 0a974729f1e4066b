"""Tensor + sequence parallelism with ZeRO on gloo ranks, against single-rank training of the same
model on the same global batch: tp=2 (2 ranks) and dp=2 x tp=2 (4 ranks).

Each rank count is one spawn that runs every case; every rank also trains the unsplit reference
itself, so only numbers cross process boundaries. Tolerance: the split model computes the same
sums in other orders (a row-parallel GEMM adds tp partial sums; the vocab-parallel softmax adds
tp partial sums of exponentials; the dp reduce-scatter adds dp partial gradients), so losses
agree to fp32 rounding (rel 1e-5) and parameters to 1e-5 absolute after 3 steps at lr 1e-2, as
the ZeRO tests allow. AdamW's eps is 1e-6 here: at the default 1e-8, an element whose gradient is
at rounding level (~1e-10) gets a step of about +-lr whichever way rounding tipped it, and one
such element in a few thousand broke 1e-5 (measured: layernorm case). Overlap on/off reorders no sum: compared bitwise
(every GEMM here has a multiple of 16 rows, see test_tensor.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mshpc.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from mshpc.mesh_shape import MeshShape
from mshpc.model.gpt import GPT
from mshpc.parallel import comm
from mshpc.parallel.apply import Parallelized, parallelize
from mshpc.parallel.mesh import build_mesh
from support.rank_runner import run_ranks
from support.single_rank import train_single_rank

# vocab 63: uneven vocab shards (31 + 32 rows); seq 32: 16 per tp rank, 2 chunks of 8
TINY = ModelConfig(vocab_size=63, seq_len=32, n_layer=2, n_head=4, d_model=32)
GLOBAL_BATCH = 4
STEPS = 3
GRAD_CLIP = 0.05  # below these steps' gradient norms: clipping acts in every case
CASES = {  # name: (overlap, grad_accum, optimizer, activation checkpointing, model changes)
    "adamw": (True, 1, "adamw", "none", {}),
    "adamw-no-overlap": (False, 1, "adamw", "none", {}),
    "adamw-accum2": (True, 2, "adamw", "none", {}),
    "lamb": (True, 1, "lamb", "none", {}),
    "parallel-block-untied-full-recompute": (True, 1, "adamw", "full", {"parallel_block": True, "tie_embeddings": False}),
    "selective-recompute-layernorm": (True, 1, "adamw", "selective", {"norm": "layernorm"}),
    "swiglu": (True, 1, "adamw", "none", {"mlp": "swiglu", "ffn_dim": 48}),
    # grouped-query: at tp=2, 2 kv heads are split over the ranks; 1 (multi-query) is replicated
    "gqa-kv2": (True, 1, "adamw", "none", {"n_kv_head": 2}),
    "mqa-kv1-selective": (True, 1, "adamw", "selective", {"n_kv_head": 1}),
    # the fused parallel block's shared gather with a copied kv head: its gradient summed too
    "mqa-parallel-block-fused": (True, 1, "adamw", "none", {"n_kv_head": 1, "parallel_block": True}),
    # its one reduce-scatter whole, against the chunks that travel behind the projection GEMMs
    "mqa-parallel-block-fused-no-overlap": (False, 1, "adamw", "none", {"n_kv_head": 1, "parallel_block": True}),
}


def config(name: str, tp: int, dp: int) -> Config:
    overlap, accum, optim, ac, model = CASES[name]
    return Config(
        model=dataclasses.replace(TINY, **model),
        parallel=ParallelConfig(dp=dp, tp=tp, tp_overlap=overlap, tp_overlap_chunks=2,
                                activation_checkpointing=ac, bucket_mb=8 / 1024),
        optim=OptimConfig(name=optim, lr=1e-2, weight_decay=0.1, grad_clip=GRAD_CLIP, eps=1e-6),
        train=TrainConfig(micro_batch=GLOBAL_BATCH // dp // accum, grad_accum=accum))


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, TINY.seq_len + 1),
                         generator=torch.Generator().manual_seed(100 + step))


def train_split(split: Parallelized, cfg: Config, dp_rank: int) -> tuple[list[float], list[float]]:
    """The train loop's step: this dp rank's part of the global batch, in micro-batches."""
    engine, dp = split.engine, cfg.parallel.dp
    losses, norms = [], []
    for step in range(STEPS):
        mine = batch(step).chunk(dp)[dp_rank]
        loss_sum = torch.zeros(())
        micros = mine.split(cfg.train.micro_batch)
        for i, micro in enumerate(micros):
            loss = split.loss_fn(engine.model(micro[:, :-1]), micro[:, 1:]) / len(micros)
            engine.backward(loss, sync=i == len(micros) - 1)
            loss_sum += loss.detach()
        comm.all_reduce(loss_sum, group=engine.group)
        norms.append(engine.step(GRAD_CLIP).item())
        losses.append(loss_sum.item() / dp)
    engine.wait_params()
    return losses, norms


def expected_shard(name: str, full: torch.Tensor, tp: int, r: int, gated: bool = False,
                   kv: int = TINY.n_head) -> torch.Tensor:
    """Which part of the unsplit parameter tp rank r must hold, written out per layer kind;
    `gated`: mlp.fc is SwiGLU's [gate; up]."""
    rows = lambda n: slice(r * n // tp, (r + 1) * n // tp)  # noqa: E731
    if gated and name.endswith("mlp.fc.weight"):  # its rows of the gate and the same of up
        gate_up = full.unflatten(0, (2, -1))
        return gate_up[:, rows(gate_up.shape[1])].flatten(0, 1)
    if name.endswith(("tok_embeddings.weight", "lm_head.weight", "mlp.fc.weight")):
        return full[rows(full.shape[0])]
    if name.endswith("attn.qkv.weight"):  # its q heads, and its kv heads (or a copy of the one it reads)
        kv_rows = kv * TINY.d_model // TINY.n_head
        q, k, v = full.split([TINY.d_model, kv_rows, kv_rows])
        if kv < tp:
            head = r * kv // tp
            return torch.cat([q[rows(q.shape[0])], *(t.unflatten(0, (kv, -1))[head] for t in (k, v))])
        return torch.cat([t[rows(t.shape[0])] for t in (q, k, v)])
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        return full[:, rows(full.shape[1])]
    return full  # norms: whole on every tp rank


def cases(rank: int, world: int, tp: int) -> dict:
    shape = MeshShape(pp=1, dp=world // tp, tp=tp)
    mesh = build_mesh(shape)
    out, models = {}, {}
    for name in CASES:
        cfg = config(name, tp, shape.dp)
        torch.manual_seed(0)
        split = parallelize(GPT(cfg.model), mesh, model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train,
                            optim=cfg.optim)
        losses, norms = train_split(split, cfg, mesh.coords.dp)
        ref_model, _, ref_losses, ref_norms = train_single_rank(cfg.model, cfg.optim, batch, STEPS)
        ref = dict(ref_model.named_parameters())
        params = dict(split.engine.model.named_parameters())
        assert params.keys() == ref.keys(), "tensor parallelism must keep the model's names"
        kv = cfg.model.kv_heads
        gated = cfg.model.mlp == "swiglu"
        mine = {n: expected_shard(n, ref[n], tp, mesh.coords.tp, gated, kv) for n in ref}
        diffs = [(params[n] - mine[n]).abs().max().item() for n in ref]
        whole = [n for n in ref if mine[n] is ref[n]]
        norms_tp = {n: comm.all_gather_json(params[n].tolist(), group=mesh.tp) for n in whole}
        out[name] = {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
                     "param_diff": max(diffs), "norms_same_on_tp_ranks": all(v[0] == v[-1] for v in norms_tp.values()),
                     # a replicated kv head's copies: the same gradient sum, so bitwise the same weights
                     "kv_copies_same": kv >= tp or _copies_same(params["layers.0.attn.qkv.weight"], mesh)}
        models[name] = (losses, split.engine.model)
    out["overlap_bitwise"] = {}
    for on, off in (("adamw", "adamw-no-overlap"), ("mqa-parallel-block-fused", "mqa-parallel-block-fused-no-overlap")):
        (on_losses, on_model), (off_losses, off_model) = models[on], models[off]
        out["overlap_bitwise"][on] = on_losses == off_losses and all(
            torch.equal(p, q) for p, q in zip(on_model.parameters(), off_model.parameters()))
    return out


def _copies_same(qkv: torch.Tensor, mesh) -> bool:
    kv_rows = comm.all_gather_json(qkv[TINY.d_model // mesh.shape.tp:].tolist(), group=mesh.tp)
    return all(rows == kv_rows[0] for rows in kv_rows)


@pytest.fixture(scope="module", params=[(2, 2), (4, 2)], ids=["tp2", "dp2-tp2"])
def ranks(request) -> list[dict]:
    world, tp = request.param
    return run_ranks(cases, world, tp, timeout_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_rank_training_with_the_same_global_batch(ranks, case):
    for rank, result in enumerate(ranks):
        r = result[case]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), f"rank {rank}"
        assert r["param_diff"] < 1e-5, f"rank {rank}"


def test_clip_norm_is_the_unsplit_models(ranks):
    for result in ranks:
        for case in CASES:
            r = result[case]
            assert min(r["ref_norms"]) > GRAD_CLIP  # clipping really acted
            assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)


def test_norm_weights_stay_identical_across_tp_ranks(ranks):
    # their partial gradients are summed over tp, so every tp rank applies the same update
    for result in ranks:
        assert all(result[case]["norms_same_on_tp_ranks"] for case in CASES)


def test_replicated_kv_heads_stay_identical_across_tp_ranks(ranks):
    # multi-query at tp=2: each rank's copy gets the gradient summed over both ranks
    assert all(result["mqa-kv1-selective"]["kv_copies_same"] for result in ranks)


def test_overlap_on_and_off_train_bitwise_alike(ranks):
    for result in ranks:
        assert all(result["overlap_bitwise"].values()), result["overlap_bitwise"]
