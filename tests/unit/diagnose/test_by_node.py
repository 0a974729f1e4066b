"""Grouping ranks by node and by tp or pp group for the report at scale."""

import numpy as np

from mshpc.diagnose.by_node import by_host, groups_by, pp_group, slowest_first, slowest_per_group
from mshpc.diagnose.timings import RankInfo
from mshpc.mesh_shape import MeshShape

SHAPE = MeshShape(pp=2, dp=4, tp=4)  # 32 ranks, nodes of 4 (one tp group each)
RANKS = [RankInfo(r, f"node{r // 4}", SHAPE.coords(r)) for r in range(SHAPE.world_size)]


def test_a_node_shows_its_slowest_rank_not_a_mean_that_hides_it():
    compute = np.ones((32, 5))
    compute[13, 2:] = 1.5  # rank 13 on node3 slows down at step 2
    compute[20, 0] = np.nan  # a step one rank lacks
    per_node = slowest_per_group(compute, by_host(RANKS))
    assert per_node.shape == (8, 5)
    assert per_node[3].tolist() == [1, 1, 1.5, 1.5, 1.5] and np.all(np.delete(per_node, 3, axis=0) == 1)


def test_slowest_first_names_the_rank_that_makes_its_group_slow():
    scores = np.ones(32)
    scores[13], scores[30] = 0.7, 0.85
    order = slowest_first(scores, by_host(RANKS))
    assert [(g.name, RANKS[r].rank) for g, r in order[:2]] == [("node3", 13), ("node7", 30)]
    pp = slowest_first(scores, groups_by(RANKS, pp_group))
    assert pp[0][0].name == "pp group (dp=3, tp=1)" and len(pp[0][0].rows) == 2
