"""A run directory of synthetic timings at any size (issue #20): config.yaml for the 175B model
at tp=8, pp=8 (pp=1 at 8 ranks) and dp = N / 64, and `timings/rank-N.jsonl` in the format the
timings thread writes, one slow rank among them. Shared by the scale benchmarks of diagnosis.

Each step shares a job-wide factor; every phase jitters (lognormal); one rank is `factor`
slower in its compute from `slow_from` on, and the collective waits for the slowest rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from mshpc.bench.harness import REPO
from mshpc.config import load_config, to_dict
from mshpc.diagnose.timings import RankInfo, header, rank_file
from mshpc.mesh_shape import MeshShape

NODE_SIZE = 8
BASE_S = {"data": 0.002, "forward": 1.6, "backward": 3.2, "optimizer": 0.05, "other": 0.01}
COMM_S = 0.1
COMPUTE = ("forward", "backward", "optimizer")
VARIANTS = 97  # distinct healthy timing histories; rank r has history r % 97 (prime: no alignment with nodes)


def shape_for(n_ranks: int) -> MeshShape:
    """tp=8 (one node), pp=8 (pp=1 below 64 ranks), dp the rest: the paper's 175B layout."""
    pp = 8 if n_ranks >= 64 else 1
    if n_ranks % (8 * pp):
        raise SystemExit(f"synthetic_run: {n_ranks} ranks is not a multiple of tp*pp={8 * pp}")
    return MeshShape(pp=pp, dp=n_ranks // (8 * pp), tp=8)


def write_config(run_dir: Path, shape: MeshShape) -> None:
    cfg = load_config(REPO / "configs" / "gpt-175b.yaml",
                      [f"parallel.pp={shape.pp}", f"parallel.dp={shape.dp}", f"parallel.tp={shape.tp}",
                       f"run.name=synthetic-{shape.world_size}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def slowest_compute(steps: int, common: np.ndarray, slow_from: int, factor: float) -> np.ndarray:
    """(steps,) the slowest rank's compute: the healthy ones' tail, or the slow rank's."""
    healthy = sum(BASE_S[p] for p in COMPUTE) * common * 1.1
    return np.where(np.arange(1, steps + 1) >= slow_from, healthy / 1.1 * max(factor, 1.1), healthy)


def rank_lines(rank: int, steps: int, common: np.ndarray, rng: np.random.Generator, slow: bool,
               slow_from: int, factor: float, noise: float) -> list[str]:
    """One rank's step lines (without its header)."""
    phases = {p: base * common * rng.lognormal(0, noise, steps) for p, base in BASE_S.items()}
    if slow:
        for p in COMPUTE:
            phases[p][slow_from - 1:] *= factor
    # the collective waits for the slowest rank: the others wait what their compute lacks of its
    compute = sum(phases[p] for p in COMPUTE)
    slowest = slowest_compute(steps, common, slow_from, factor)
    phases["comm.reduce_scatter"] = COMM_S * common + np.maximum(slowest - compute, 0.0)
    step_s = sum(phases.values())
    names = list(phases)
    columns = [phases[p] for p in names]
    lines = []
    for i in range(steps):
        body = ", ".join(f'"{p}": {c[i]:.7f}' for p, c in zip(names, columns, strict=True))
        lines.append(f'{{"step": {i + 1}, "time": {1.7e9 + 5 * i:.3f}, "step_s": {step_s[i]:.7f}, '
                     f'"spans": 40, "phases": {{{body}}}}}\n')
    return lines


def write_run(run_dir: Path, n_ranks: int, steps: int, slow_rank: int | None,
              slow_from: int = 100, factor: float = 1.3, noise: float = 0.03, seed: int = 0) -> MeshShape:
    """Write config.yaml and every rank's timings file; returns the mesh."""
    shape = shape_for(n_ranks)
    write_config(run_dir, shape)
    rng = np.random.default_rng(seed)
    common = rng.lognormal(0, noise, steps)
    variants: dict[int, str] = {}  # VARIANTS healthy bodies, reused: formatting 12 million lines is the slow part
    for rank in range(n_ranks):
        info = RankInfo(rank, f"node{rank // NODE_SIZE:04d}", shape.coords(rank))
        path = rank_file(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        slow = rank == slow_rank
        key = -1 if slow else rank % VARIANTS
        if key not in variants:
            variants[key] = "".join(rank_lines(rank, steps, common, rng, slow, slow_from,
                                               factor if slow_rank is not None else 1.0, noise))
        with path.open("w") as f:
            f.write(json.dumps(header(info, "cuda", 0)) + "\n")
            f.write(variants[key])
        if slow:
            del variants[key]
    return shape
