"""The checkpoint's control plane at N = 8 ... 12,288 ranks (issue #20, part 3): manifest size,
the bytes the save's exchange of entries moves (to every rank before, to rank 0 now), rank 0's
commit time (manifest and its index), and one rank's restore after a dp change (1,536 -> 1,024
nodes at 12,288 ranks; dp x 2/3 at every N): before, the whole manifest parsed, then the plan;
now (catalog.py), the index and the manifest's head, the entries of the names its dp group asks
for (what the plan reads), and the model/ entries the resume's copy check reads.

The 175B model (configs/gpt-175b.yaml) at tp=8, pp=8 (pp=1 at 8 ranks): each stage's parameter
sizes come from the real model built on the meta device, cut by tp as parallel/apply.py cuts
them (every Linear and the embedding split, norms whole), packed by the real ZeRO bucket code
(`zero_build.build_layouts`, `BucketLayout.pieces`), so each rank's manifest entries are the
ones its saver would write: master and both moments per piece, its share of the dp-replicated
model weights, its RNG. Only the bytes are missing: the planner and the manifest never read them.
The planner is the real `group_read.plan_reads` for one new dp group, each new rank asking for
its new pieces (what ZeroEngine.load_state_slices reads).

    .venv/bin/python benchmarks/scale/checkpoint_scale.py [--n 8 64 512 4096 12288]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from synthetic_run import shape_for  # a sibling module: Python puts benchmarks/scale/ first on the path
from torch import nn

from mshpc.bench import harness
from mshpc.bench.harness import REPO
from mshpc.checkpoint.catalog import open_catalog
from mshpc.checkpoint.group_read import plan_reads
from mshpc.checkpoint.manifest import (
    INDEX_FILE,
    Manifest,
    TensorEntry,
    grouped_by_name,
    read_manifest,
    write_manifest,
)
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.state import spread
from mshpc.config import Config, load_config
from mshpc.mesh_shape import Coords, MeshShape
from mshpc.model.gpt import Block
from mshpc.parallel.buckets import BucketLayout
from mshpc.parallel.sharded_optim import STATE_KEYS
from mshpc.parallel.zero_build import build_layouts

Param = tuple[str, tuple[int, ...], bool]  # checkpoint key, shape at this tp, tp-replicated


def stage_params(cfg: Config, pp_rank: int, tp_rank: int) -> list[Param]:
    """One (pp, tp) rank's parameters, in registration order, shaped as tp cuts them."""
    m, tp, pp = cfg.model, cfg.parallel.tp, cfg.parallel.pp
    with torch.device("meta"):
        block = Block(m)
    per = m.n_layer // pp
    out: list[Param] = []

    def add(name: str, shape: tuple[int, ...], split: bool) -> None:
        cut = (shape[0] // tp, *shape[1:]) if split else shape
        out.append((f"{name}@tp{tp_rank}" if split and tp > 1 else name, cut, not split))

    if pp_rank == 0:
        add("tok_embeddings.weight", (m.vocab_size, m.d_model), True)
    for layer in range(pp_rank * per, (pp_rank + 1) * per):
        for name, p in block.named_parameters():
            owner = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
            add(f"layers.{layer}.{name}", tuple(p.shape), isinstance(owner, nn.Linear))
    if pp_rank == pp - 1:
        add("norm.weight", (m.d_model,), False)
        add("lm_head.weight", (m.vocab_size, m.d_model), True)
    return out


def rank_entries(params: list[Param], layouts: list[BucketLayout], dp_rank: int, dp: int, rank: int,
                 offset: int) -> tuple[list[TensorEntry], int]:
    """The entries rank `rank` (dp rank `dp_rank` of its (pp, tp)) writes to its shard."""
    file, out = f"shard-{rank:05d}.h5", []

    def entry(name: str, shape: tuple[int, ...], start: int, numel: int, dtype: str = "float32") -> None:
        nonlocal offset
        out.append(TensorEntry(name, shape, dtype, file, name, start, numel, 0, offset))
        offset += numel * 4

    for layout in layouts:
        for piece in layout.pieces(dp_rank):
            key, shape, replicated = params[piece.index]
            if replicated and "@tp" not in key and rank % 8:  # a tp-replicated weight: tp rank 0 saves it
                continue
            for prefix in ("master", *(f"optim.{k}" for k in STATE_KEYS)):
                entry(f"{prefix}/{key}", shape, piece.param_start, piece.numel)
    sizes = [int(np.prod(s)) * 2 for _, s, _ in params]
    for i, owner in enumerate(spread(sizes, dp)):
        key, shape, replicated = params[i]
        if owner == dp_rank and not (replicated and rank % 8):
            entry(f"model/{key}", shape, 0, int(np.prod(shape)), "bfloat16")
    entry(f"rng/cpu/rank-{rank}", (5056,), 0, 5056, "uint8")
    return out, offset


def layouts_for(params: list[Param], cfg: Config, dp: int) -> list[BucketLayout]:
    bucket_numel = int(cfg.parallel.bucket_mb * 2**20) // 4
    plans = build_layouts([int(np.prod(s)) for _, s, _ in params], [r for _, _, r in params],
                          [False] * len(params), bucket_numel, (dp,))
    return [plan.layout for plan in plans]


def manifest_for(cfg: Config, shape: MeshShape) -> Manifest:
    entries: list[TensorEntry] = []
    for pp_rank in range(shape.pp):
        for tp_rank in range(shape.tp):
            params = stage_params(cfg, pp_rank, tp_rank)
            layouts = layouts_for(params, cfg, shape.dp)
            for dp_rank in range(shape.dp):
                rank = shape.rank(Coords(pp=pp_rank, dp=dp_rank, tp=tp_rank))
                mine, _ = rank_entries(params, layouts, dp_rank, shape.dp, rank, 4096)
                entries += mine
    return Manifest(step=1000, config_hash="synthetic", layout={"dp": shape.dp, "tp": shape.tp, "pp": shape.pp},
                    tensors=tuple(entries), created_unix=time.time())  # in rank order, as the reports arrive


def new_group_needs(cfg: Config, new_dp: int) -> list[list[tuple[str, int, int]]]:
    """What each rank of one new dp group (pp=0, tp=0) asks for: its new pieces' ranges."""
    params = stage_params(cfg, 0, 0)
    layouts = layouts_for(params, cfg, new_dp)
    needs = []
    for dp_rank in range(new_dp):
        requests = []
        for layout in layouts:
            for piece in layout.pieces(dp_rank):
                key = params[piece.index][0]
                requests += [(f"{prefix}/{key}", piece.param_start, piece.numel)
                             for prefix in ("master", *(f"optim.{k}" for k in STATE_KEYS))]
        needs.append(requests)
    return needs


def exchange_bytes(manifest: Manifest, n: int) -> dict[str, int]:
    """Bytes the save's entries exchange moves, from each rank's report as the saver sends it
    (`{"error": null, "entries": [...]}`, padded to the longest as gloo needs): all_gather_json
    (before) delivers every report to every rank, gather_json (now) to rank 0 only."""
    per_rank: dict[str, int] = {}
    for e in manifest.tensors:
        per_rank[e.file] = per_rank.get(e.file, 33) + len(json.dumps(dataclasses.asdict(e))) + 2
    longest = max(per_rank.values())
    return {"report_bytes_longest": longest, "all_gather_bytes_total": n * n * longest,
            "all_gather_bytes_per_rank": n * longest, "gather_bytes_total": n * (8 + longest),
            "gather_bytes_other_ranks_receive": 0}


def slope(ns: list[int], values: list[float]) -> float:
    return round(float(np.polyfit(np.log(ns), np.log(values), 1)[0]), 3)


def emit(**fields: object) -> None:
    harness.emit({"bench": "scale_checkpoint", **fields})


def restore_before(folder: Path, needs: list[list[tuple[str, int, int]]]) -> dict[str, float]:
    """One rank's restore planning as it was: the whole manifest parsed, then the group's plan."""
    start = time.perf_counter()
    manifest = read_manifest(folder)
    parse = time.perf_counter() - start
    reader = CheckpointReader(folder, manifest)  # the planner reads no shard bytes
    start = time.perf_counter()
    plan = plan_reads(reader, needs)
    plan_s = time.perf_counter() - start
    return {"parse_s": parse, "plan_s": plan_s, "restore_before_s": parse + plan_s,
            "bytes_parsed_before": (folder / "manifest.json").stat().st_size, "plan_assignments": len(plan)}


def restore_after(folder: Path, needs: list[list[tuple[str, int, int]]]) -> dict[str, float]:
    """The same rank's now: the index and head, the plan (parsing its group's names' entries),
    then the model/ entries the copy check spreads over the ranks."""
    start = time.perf_counter()
    catalog = open_catalog(folder)
    open_s = time.perf_counter() - start
    reader = CheckpointReader(folder, catalog)
    start = time.perf_counter()
    plan = plan_reads(reader, needs)
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    reader.prefetch(set(reader.names("model/")))
    model_s = time.perf_counter() - start
    assert catalog.indexed, "the index was not used"
    return {"open_s": open_s, "plan_after_s": plan_s, "model_names_s": model_s,
            "restore_after_s": open_s + plan_s + model_s, "bytes_parsed_after": catalog.bytes_parsed,
            "plan_assignments_after": len(plan)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8, 64, 512, 4096, 12288])
    args = ap.parse_args()
    keys = ["manifest_bytes", "commit_s", "parse_s", "plan_s", "restore_before_s", "bytes_parsed_before",
            "restore_after_s", "bytes_parsed_after", "plan_after_s"]
    rows: dict[str, list[float]] = {k: [] for k in keys}
    ns = sorted(args.n)
    for n in ns:
        shape = shape_for(n)
        cfg = load_config(REPO / "configs" / "gpt-175b.yaml",
                          [f"parallel.pp={shape.pp}", f"parallel.dp={shape.dp}", f"parallel.tp={shape.tp}"])
        manifest = manifest_for(cfg, shape)
        new_dp = max(1, shape.dp * 2 // 3)
        needs = new_group_needs(cfg, new_dp)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            start = time.perf_counter()  # rank 0's commit: group the entries, write the index and manifest
            write_manifest(folder, dataclasses.replace(manifest, tensors=grouped_by_name(list(manifest.tensors))))
            commit = time.perf_counter() - start
            size = (folder / "manifest.json").stat().st_size
            index_bytes = (folder / INDEX_FILE).stat().st_size
            entries, exchange = len(manifest.tensors), exchange_bytes(manifest, n)
            del manifest  # a restoring rank holds only what it parses
            after = restore_after(folder, needs)  # first: the page cache favours neither
            before = restore_before(folder, needs)
        assert after.pop("plan_assignments_after") == before["plan_assignments"], "the plans differ"
        fields = {"manifest_bytes": size, "commit_s": commit, **before, **after}
        for key in keys:
            rows[key].append(fields[key])
        emit(N=n, dp=shape.dp, new_dp=new_dp, entries=entries, index_bytes=index_bytes, **{k: round(v, 4) if isinstance(v, float) else v for k, v in fields.items()},
             plan_group_ranks=new_dp, plan_requests=sum(map(len, needs)),
             ratio_restore_after_vs_before=round(after["restore_after_s"] / before["restore_before_s"], 4),
             ratio_bytes_parsed_after_vs_before=round(after["bytes_parsed_after"] / before["bytes_parsed_before"], 5),
             **exchange)
    if len(ns) > 1:
        emit(metric="growth_exponent", unit="log-log slope", N=ns, **{k: slope(ns, v) for k, v in rows.items()})
        big = [i for i, n in enumerate(ns) if n >= 512]
        if len(big) > 1:
            emit(metric="growth_exponent_from_512", unit="log-log slope", N=[ns[i] for i in big],
                 **{k: slope([ns[i] for i in big], [v[i] for i in big]) for k, v in rows.items()})


if __name__ == "__main__":
    main()
