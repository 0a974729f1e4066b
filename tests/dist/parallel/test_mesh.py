"""build_mesh on 8 gloo ranks (dp2 x tp2 x pp2, ep2): every group holds the ranks it should, and
a collective over it reaches exactly them. (At ep = 1 no expert group is made: test_store_ops
counts the groups' addresses.)"""

import torch
import torch.distributed as dist

from mshpc.mesh_shape import GROUP_NAMES, MeshShape
from mshpc.parallel import comm
from mshpc.parallel.mesh import build_mesh
from support.rank_runner import run_ranks

SHAPE = MeshShape(pp=2, dp=2, tp=2, ep=2)


def groups_seen(rank: int, world: int) -> dict:
    mesh = build_mesh(SHAPE)
    out = {"coords": [mesh.coords.pp, mesh.coords.dp, mesh.coords.tp], "embedding_stage": mesh.is_embedding_stage}
    for name in GROUP_NAMES:
        group = getattr(mesh, name)
        total = torch.tensor([float(rank)])
        comm.all_reduce(total, group=group)
        out[name] = {"members": comm.all_gather_json(rank, group=group), "sum": total.item(),
                     # to the group's first rank only, values of different lengths
                     "gathered": comm.gather_json({"r": rank, "pad": "x" * rank}, dst=dist.get_global_rank(group, 0),
                                                  group=group)}
    return out


def test_dp2_tp2_pp2_groups_hold_the_right_ranks():
    results = run_ranks(groups_seen, SHAPE.world_size, timeout_s=240)
    for rank, seen in enumerate(results):
        c = SHAPE.coords(rank)
        assert seen["coords"] == [c.pp, c.dp, c.tp]
        assert seen["embedding_stage"]  # pp=2: both stages hold the embedding
        for name, ranks in SHAPE.group_ranks(rank).items():
            assert seen[name]["members"] == list(ranks), (rank, name)
            assert seen[name]["sum"] == sum(ranks), (rank, name)
            expected = [{"r": r, "pad": "x" * r} for r in ranks] if rank == ranks[0] else None
            assert seen[name]["gathered"] == expected, (rank, name)
    # spot checks against the layout written out by hand: tp innermost, then dp, then pp
    assert results[5]["tp"]["members"] == [4, 5] and results[5]["dp"]["members"] == [5, 7]
    assert results[5]["pp"]["members"] == [1, 5] and results[5]["mp"]["members"] == [0, 1, 4, 5]
    assert results[5]["ep"]["members"] == [5, 7] and results[5]["edp"]["members"] == [5]
