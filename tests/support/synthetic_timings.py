"""Synthetic per-rank timings of a synchronous job on a 2 x 2 x 2 mesh, for the diagnosis tests."""

import json

import numpy as np

from mshpc.diagnose.timings import RankInfo, header, rank_file
from mshpc.mesh_shape import MeshShape

MESH = MeshShape(pp=2, dp=2, tp=2)  # 8 ranks, so the coordinates in a flag are checkable
BASE_S = {"data": 0.002, "forward": 0.10, "backward": 0.20, "optimizer": 0.03, "other": 0.005}
COMM_S = 0.05


def synthetic(steps: int, seed: int, slow_rank: int | None = None, slow_from: int = 0,
              slow_phases: tuple[str, ...] = ("forward", "backward", "optimizer"), factor: float = 1.15,
              noise: float = 0.05, world: int = MESH.world_size) -> list[dict[int, dict]]:
    """Per rank {step: record} of a synchronous data-parallel job: every phase jitters (lognormal
    `noise`), every step shares a job-wide factor, 1% of (rank, step) pairs spike 1.5-3x in
    backward (a GC pause, an interrupt), and the collective waits for the slowest rank's compute."""
    rng = np.random.default_rng(seed)
    records: list[dict[int, dict]] = [{} for _ in range(world)]
    for step in range(1, steps + 1):
        common = rng.lognormal(0, noise)
        phases = [{p: base * common * rng.lognormal(0, noise) for p, base in BASE_S.items()} for _ in range(world)]
        for r in range(world):
            if rng.random() < 0.01:
                phases[r]["backward"] *= rng.uniform(1.5, 3.0)
            if r == slow_rank and step >= slow_from:
                for p in slow_phases:
                    phases[r][p] *= factor
        compute = [ph["forward"] + ph["backward"] + ph["optimizer"] for ph in phases]
        for r in range(world):
            phases[r]["comm.reduce_scatter"] = COMM_S * common + max(compute) - compute[r]
            records[r][step] = {"step": step, "step_s": sum(phases[r].values()), "phases": phases[r]}
    return records


def ranks(mesh: MeshShape = MESH, host=lambda r: f"node{r // 4}") -> list[RankInfo]:
    return [RankInfo(r, host(r), mesh.coords(r)) for r in range(mesh.world_size)]


def write_files(run_dir, records, start_step=0, mesh: MeshShape | None = None, host=lambda r: f"node{r // 4}"):
    """Each rank's timings file (appended to: a restart's header, then its steps); `mesh`, when
    given, goes into the headers as the run's layout."""
    for info, recs in zip(ranks(mesh or MESH, host), records, strict=True):
        path = rank_file(run_dir, info.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(header(info, "cpu", start_step, mesh)) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in recs.values())




def watch_lines(run_dir, records, ranks_per_file=4):
    """Start every rank's timings file and watch stream writer (as a new process does) and return
    (per rank, each step's JSON line bytes and watch record fields, the record pointing at its
    line; the writers)."""
    from mshpc.diagnose.timers import category
    from mshpc.diagnose.watch_stream import StreamWriter

    out, writers = [], []
    for info, recs in zip(ranks(), records, strict=True):
        path = rank_file(run_dir, info.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(header(info, "cpu", 0)) + "\n")
        writers.append(StreamWriter(run_dir, info.rank, header(info, "cpu", 0), 0, ranks_per_file))
        offset, steps = path.stat().st_size, []
        for r in recs.values():
            line = (json.dumps(r) + "\n").encode()
            blamed = [sum(v for p, v in r["phases"].items() if category(p) == c) for c in ("compute", "data wait")]
            steps.append((line, (r["step"], r["step_s"], *blamed, offset)))
            offset += len(line)
        out.append(steps)
    return out, writers
