"""Pipeline links under lazily connected gloo (launch.rendezvous.connect_lazily): the two ends of
a pipeline post sends and receives on several links in different orders, which deadlocked while
a pair connected inside the first post on it; build_links now connects every pair first."""

import torch
import torch.distributed as dist

from mshpc.mesh_shape import MeshShape
from mshpc.parallel import comm
from mshpc.parallel.mesh import build_mesh
from mshpc.parallel.pipeline import build_links, link_edges
from support.rank_runner import run_ranks

ROUNDS = 8  # fresh links each round: unconnected, it hung 1 run in 2, as the pairs' addresses fell


def cross_order(rank: int, world: int) -> list[float]:
    mesh = build_mesh(MeshShape(pp=2, dp=1, tp=1))
    got = []
    for _ in range(ROUNDS):
        links = build_links(mesh, virtual_stages=1)
        peer = links.ranks[1 - mesh.coords.pp]
        buf = torch.zeros(4)
        if mesh.coords.pp == 0:
            # as 1F1B's first stage: its grad receive is posted before its activation goes out
            grad = comm.irecv(buf, peer, links.groups["grad"])
            comm.isend(torch.ones(4), peer, links.groups["act"]).wait()
            grad.wait()
        else:
            comm.irecv(buf, peer, links.groups["act"]).wait()
            comm.isend(buf * 10, peer, links.groups["grad"]).wait()
        got.append(float(buf.sum()))
    dist.barrier()
    return got


def test_links_posted_in_crossed_orders_do_not_deadlock():
    first, last = run_ranks(cross_order, 2, timeout_s=60)
    assert first == [40.0] * ROUNDS  # the activation came back as its gradient, x10
    assert last == [4.0] * ROUNDS


def test_link_edges_join_neighbours_and_the_wrap_around():
    assert link_edges("act", 4) == [(0, 1), (1, 2), (2, 3)] == link_edges("grad", 4)
    assert link_edges("act_wrap", 4) == [(0, 3)] == link_edges("grad_wrap", 4)
    assert link_edges("act", 1) == [] == link_edges("grad_wrap", 1)
