"""The report past 64 ranks: one line per node, slowest first, the straggler's node open on its
ranks; every figure still drawn (rows by node, not one label per rank)."""

import re

import numpy as np
import yaml

from mshpc.config import load_config, to_dict
from mshpc.diagnose.report import write_report
from mshpc.mesh_shape import MeshShape
from support.synthetic_timings import write_files

SHAPE = MeshShape(pp=2, dp=16, tp=4)  # 128 ranks, 4 per node
SLOW = 77


def test_a_straggler_among_128_ranks_is_the_first_node_named(tmp_path):
    cfg = load_config(None, [f"parallel.pp={SHAPE.pp}", f"parallel.dp={SHAPE.dp}", f"parallel.tp={SHAPE.tp}",
                             "model.n_head=4", "run.name=wide"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    rng = np.random.default_rng(0)
    records = []
    for r in range(SHAPE.world_size):
        forward = 0.1 * rng.lognormal(0, 0.03, 40) * (1.4 if r == SLOW else 1.0)
        records.append({s: {"step": s, "step_s": float(forward[s - 1] + 0.2),
                            "phases": {"forward": float(forward[s - 1]), "comm.all_reduce": 0.2}}
                        for s in range(1, 41)})
    write_files(tmp_path, records, mesh=SHAPE, host=lambda r: f"node{r // 4:02d}")
    index, summary = write_report(tmp_path)
    assert summary[2].startswith(f"  rank {SLOW} on node19 ")
    page = index.read_text()
    nodes = re.findall(r"<details( open)?><summary>(node\d+): slowest rank (\d+)", page)
    assert len(nodes) == SHAPE.world_size // 4
    assert nodes[0] == (" open", "node19", str(SLOW)) and all(not opened for opened, _, _ in nodes[1:])
    first = page[page.index("<details open>"):page.index("</details>")]
    assert first.count("<tr>") == 1 + 4  # its head and its four ranks
    for png in ("heatmap.png", "breakdown.png", "mesh.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000
