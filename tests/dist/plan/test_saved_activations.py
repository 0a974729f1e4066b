"""Under tensor + sequence parallelism (gloo, tp = 2 and 4): the bytes each block saves,
measured, equal the plan's formula; the sequence-parallel input is kept as its 1/tp shard, never
gathered whole; and the fused parallel block issues one all-gather and one reduce-scatter per
layer forward where the serial block issues two of each (counted from the flight recorder)."""

import dataclasses

import pytest
import torch

from mshpc.config import ParallelConfig
from mshpc.mesh_shape import MeshShape
from mshpc.model.gpt import GPT
from mshpc.parallel import comm
from mshpc.parallel.apply import apply_tp
from mshpc.parallel.mesh import build_mesh
from mshpc.plan.saved_activations import layer_bytes, measure
from support.rank_runner import run_ranks
from unit.plan.test_saved_activations import B, M, VARIANTS, formula

CASES = [(pb, ck, docs, win) for pb in (False, True) for ck in ("none", "selective", "full")
         for docs, win in ((1, None), (3, 16))]
# at tp=2: SwiGLU, 2 kv heads split over the ranks, 1 kv head copied on each (Megatron's rule)
VARIANT_CASES = [("swiglu", True, None), ("gqa", False, torch.bfloat16), ("mqa", True, None),
                 ("llama", False, torch.bfloat16)]


def collectives_per_layer(group, parallel_block: bool) -> dict[str, int]:
    """Ops of the tp group the middle layer issues in forward, by name."""
    model = GPT(dataclasses.replace(M, parallel_block=parallel_block))
    apply_tp(model, group, ParallelConfig(tp=2, tp_overlap=True, tp_overlap_chunks=2))
    layer, seqs = model.layers["1"], {}

    def mark(key):
        return lambda *_: seqs.__setitem__(key, comm.RECORDER.snapshot()[-1].seq)

    layer.register_forward_pre_hook(mark("f0"))
    layer.register_forward_hook(mark("f1"))
    x = torch.randint(0, M.vocab_size, (B, M.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(x)
    counts: dict[str, int] = {}
    for rec in comm.RECORDER.snapshot():
        if seqs["f0"] < rec.seq <= seqs["f1"]:
            counts[f"forward.{rec.op}"] = counts.get(f"forward.{rec.op}", 0) + 1
    return counts


def cases(rank, world):
    mesh = build_mesh(MeshShape(pp=1, dp=1, tp=world))
    out = {"bytes": [], "full_size_saved": []}
    for pb, ck, docs, win in CASES if world == 2 else CASES[::2]:  # tp=4: without masks (4 ranks on 2 cores)
        m = dataclasses.replace(M, parallel_block=pb, sliding_window=win)
        for ac in (None, torch.bfloat16) if world == 2 else (torch.bfloat16,):
            record = measure(m, ck, B, mesh.tp, documents=docs, autocast=ac)
            out["bytes"].append([pb, ck, docs, win, str(ac), layer_bytes(record, M.n_layer),
                                 formula(m, ck, world, docs > 1, 2 if ac else 4)])
            # a gathered input saved would be the whole sequence at full width, made inside the
            # linear's autograd function (no grad_fn of its own)
            out["full_size_saved"] += [str(t) for t in record.tensors.get(1, [])
                                       if t[0] == (B, M.seq_len, M.d_model) and t[3] == "NoneType"]
    if world == 2:
        for variant, pb, ac in VARIANT_CASES:
            m = dataclasses.replace(M, parallel_block=pb, **VARIANTS[variant])
            got = layer_bytes(measure(m, "none", B, mesh.tp, autocast=ac), M.n_layer)
            out["bytes"].append([variant, pb, str(ac), got, formula(m, "none", world, False, 2 if ac else 4)])
        out["collectives"] = {kind: collectives_per_layer(mesh.tp, kind == "parallel") for kind in ("serial", "parallel")}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def ranks(request):
    return run_ranks(cases, request.param, timeout_s=240)


def test_formula_is_the_measured_bytes(ranks):
    for r in ranks:
        for *case, got, want in r["bytes"]:
            assert got == pytest.approx(want, rel=0.05), case


def test_sequence_parallel_input_is_saved_as_its_shard(ranks):
    for r in ranks:
        assert r["full_size_saved"] == []


def test_fused_parallel_block_halves_the_collectives_per_layer(ranks):
    if "collectives" not in ranks[0]:
        pytest.skip("counted at tp=2")
    for r in ranks:
        serial, fused = r["collectives"]["serial"], r["collectives"]["parallel"]
        # 2 chunks each (tp_overlap_chunks=2): a collective of the layer is 2 recorded ops
        assert serial == {"forward.all_gather": 4, "forward.reduce_scatter": 4}
        assert fused == {"forward.all_gather": 2, "forward.reduce_scatter": 2}
