"""The tensor/sequence-parallel layers on 2 gloo ranks against nn.Linear, nn.Embedding and
F.cross_entropy on one rank, forward and backward; and the chunked (overlapped) path against
the unchunked one, bitwise.

Tolerance: a row-parallel GEMM sums its inner dimension in tp parts and adds them, a different
order of fp32 additions than one GEMM; and a BLAS may round a row differently when a GEMM has
fewer rows (MKL's AVX-512 kernels: a GEMM whose row count is not a multiple of 16 goes through
edge kernels). So layers match the single-rank ones to fp32 rounding, and the chunked path is
bitwise the unchunked one where every GEMM has a multiple of 16 rows."""

import pytest
import torch
import torch.nn.functional as F
from support.rank_runner import run_ranks

from mshpc.mesh_shape import MeshShape
from mshpc.parallel import comm
from mshpc.parallel.mesh import build_mesh
from mshpc.parallel.tensor import ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy
from mshpc.parallel.tp_split import chunk_bounds
from mshpc.parallel.vocab_embedding import VocabParallelEmbedding

B, S, D_IN, D_OUT, VOCAB = 2, 12, 8, 6, 7  # VOCAB=7: uneven shards of 4 and 3 rows
ALIGNED_S = 64  # tp=2, 2 chunks: GEMMs of B*2*16 = 64 rows, and 128 unchunked


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    return (a - b).abs().max().item()


def column_case(rank, tp, group, chunks, S=S):
    x, w, g = randn(B, S, D_IN, seed=1), randn(D_OUT, D_IN, seed=2), randn(B, S, D_OUT, seed=3)
    rows, seq = slice(rank * D_OUT // tp, (rank + 1) * D_OUT // tp), slice(rank * S // tp, (rank + 1) * S // tp)
    ref_x, ref = x.clone().requires_grad_(), torch.nn.Linear(D_IN, D_OUT, bias=False)
    ref.weight.data.copy_(w)
    (ref(ref_x) * g).sum().backward()
    layer = ColumnParallelLinear(w[rows].clone(), group, chunks)
    local_x = x[:, seq].clone().requires_grad_()
    y = layer(local_x)
    (y * g[..., rows]).sum().backward()
    return {"y": max_diff(y, ref(x)[..., rows]), "dx": max_diff(local_x.grad, ref_x.grad[:, seq]),
            "dw": max_diff(layer.weight.grad, ref.weight.grad[rows])}, (y, local_x.grad, layer.weight.grad)


def row_case(rank, tp, group, chunks, S=S):
    x, w, g = randn(B, S, D_IN, seed=4), randn(D_OUT, D_IN, seed=5), randn(B, S, D_OUT, seed=6)
    cols, seq = slice(rank * D_IN // tp, (rank + 1) * D_IN // tp), slice(rank * S // tp, (rank + 1) * S // tp)
    ref_x, ref = x.clone().requires_grad_(), torch.nn.Linear(D_IN, D_OUT, bias=False)
    ref.weight.data.copy_(w)
    (ref(ref_x) * g).sum().backward()
    layer = RowParallelLinear(w[:, cols].clone(), group, chunks)
    local_x = x[..., cols].clone().requires_grad_()
    y = layer(local_x)
    (y * g[:, seq]).sum().backward()
    return {"y": max_diff(y, ref(x)[:, seq]), "dx": max_diff(local_x.grad, ref_x.grad[..., cols]),
            "dw": max_diff(layer.weight.grad, ref.weight.grad[:, cols])}, (y, local_x.grad, layer.weight.grad)


def embedding_case(rank, tp, group):
    idx = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(7))
    w, g = randn(VOCAB, D_IN, seed=8), randn(B, S, D_IN, seed=9)
    lo, hi = chunk_bounds(VOCAB, tp)[rank]  # (0, 3), (3, 7): the layer splits the vocabulary so
    seq = slice(rank * S // tp, (rank + 1) * S // tp)
    ref = torch.nn.Embedding(VOCAB, D_IN)
    ref.weight.data.copy_(w)
    (ref(idx) * g).sum().backward()
    layer = VocabParallelEmbedding(w[lo:hi].clone(), VOCAB, group)
    before = len(comm.RECORDER.snapshot())
    y = layer(idx)
    (y * g[:, seq]).sum().backward()
    sent = comm.RECORDER.snapshot()[before:]
    # rows that change hands: the other shard's positions holding my tokens (forward), and my
    # positions holding the other rank's tokens (backward, their gradients)
    mine, here = (idx >= lo) & (idx < hi), torch.zeros(B, S, dtype=torch.bool)
    here[:, seq] = True
    rows = int((mine & ~here).sum()) + int((~mine & here).sum())
    return {"y": max_diff(y, ref(idx)[:, seq]), "dw": max_diff(layer.weight.grad, ref.weight.grad[lo:hi]),
            "ops": [r.op for r in sent], "bytes": sum(r.nbytes for r in sent), "expected_bytes": rows * D_IN * 4}


def cross_entropy_case(rank, tp, group):
    logits = randn(B, S, VOCAB, seed=10) * 3
    targets = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(11))
    targets[0, :3] = -100  # ignored positions
    lo, hi = [(0, 4), (4, 7)][rank]
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref.backward()
    local = logits[..., lo:hi].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, lo, group)
    loss.backward()
    return {"loss": abs(loss.item() - ref.item()), "dlogits": max_diff(local.grad, ref_logits.grad[..., lo:hi])}


def autocast_case(rank, tp, group):
    """Under bf16 autocast (CPU's here, CUDA's on a GPU) the layers compute and communicate in
    bf16 and hand back gradients in the parameters' fp32, close to the fp32 ones."""
    x, w1, w2 = randn(B, S, D_IN, seed=12), randn(D_OUT, D_IN, seed=13), randn(D_IN, D_OUT, seed=14)
    rows = slice(rank * D_OUT // tp, (rank + 1) * D_OUT // tp)
    seq = slice(rank * S // tp, (rank + 1) * S // tp)
    ref_x = x.clone().requires_grad_()
    (F.linear(F.linear(ref_x, w1), w2) ** 2).sum().backward()
    col, row = ColumnParallelLinear(w1[rows].clone(), group, 2), RowParallelLinear(w2[:, rows].clone(), group, 2)
    local_x = x[:, seq].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = col(local_x)
        y = row(hidden)
    (y.float() ** 2).sum().backward()
    scale = ref_x.grad.abs().max().item()
    return {"dtypes": [str(hidden.dtype), str(y.dtype), str(local_x.grad.dtype), str(col.weight.grad.dtype)],
            "dx_rel": max_diff(local_x.grad, ref_x.grad[:, seq]) / scale}


def layers(rank, world):
    mesh = build_mesh(MeshShape(pp=1, dp=1, tp=world))
    out = {}
    for name, case in (("column", column_case), ("row", row_case)):
        out[name] = case(rank, world, mesh.tp, 1)[0]
        out[f"{name}_chunked"] = case(rank, world, mesh.tp, 4)[0]  # s/tp = 6 rows in chunks of 2, 2, 1, 1
        whole, chunked = case(rank, world, mesh.tp, 1, ALIGNED_S)[1], case(rank, world, mesh.tp, 2, ALIGNED_S)[1]
        out[f"{name}_chunked_vs_whole_bitwise"] = [torch.equal(a, b) for a, b in zip(whole, chunked)]
    out["embedding"] = embedding_case(rank, world, mesh.tp)
    out["cross_entropy"] = cross_entropy_case(rank, world, mesh.tp)
    out["autocast"] = autocast_case(rank, world, mesh.tp)
    return out


def embedding_only(rank, world):
    return {"embedding": embedding_case(rank, world, build_mesh(MeshShape(pp=1, dp=1, tp=world)).tp)}


@pytest.fixture(scope="module")
def tp4_embedding():  # VOCAB=7 over 4 ranks: parts of 1, 2, 2, 2 rows; each rank exchanges with 3
    return run_ranks(embedding_only, 4, timeout_s=120)


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(layers, 2, timeout_s=120)


@pytest.mark.parametrize("layer", ["column", "row", "column_chunked", "row_chunked"])
def test_linear_layers_match_nn_linear(tp2, layer):
    for rank, r in enumerate(tp2):
        # fp32 rounding: row-parallel sums its inner dimension in two halves
        assert max(r[layer].values()) < 1e-5, (rank, r[layer])


@pytest.mark.parametrize("layer", ["column", "row"])
def test_overlapped_chunks_are_bitwise_the_whole_collective(tp2, layer):
    for r in tp2:
        assert r[f"{layer}_chunked_vs_whole_bitwise"] == [True, True, True]  # output, dx, dw


@pytest.mark.parametrize("ranks", ["tp2", "tp4_embedding"])
def test_vocab_parallel_embedding_with_uneven_shards_matches_nn_embedding(ranks, request):
    for r in request.getfixturevalue(ranks):
        # each output row and each gradient row is one table row or one output gradient: exact
        assert (r["embedding"]["y"], r["embedding"]["dw"]) == (0.0, 0.0)


@pytest.mark.parametrize("ranks", ["tp2", "tp4_embedding"])
def test_vocab_parallel_embedding_sends_only_the_rows_that_change_hands(ranks, request):
    for r in request.getfixturevalue(ranks):  # not the (b, s, d) reduce-scatter and all-gather of Megatron's
        assert r["embedding"]["ops"] == ["all_to_all_v", "all_to_all_v"]
        assert r["embedding"]["bytes"] == r["embedding"]["expected_bytes"] > 0


def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(tp2):
    for r in tp2:
        assert r["cross_entropy"]["loss"] < 1e-6 and r["cross_entropy"]["dlogits"] < 1e-7


def test_bf16_autocast_computes_in_bf16_and_returns_fp32_gradients(tp2):
    for r in tp2:
        assert r["autocast"]["dtypes"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32"]
        assert r["autocast"]["dx_rel"] < 5e-2  # bf16's 8-bit mantissa, two GEMMs deep
