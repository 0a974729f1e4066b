"""Collective tests, as nccl-tests runs them: for each operation and size, one run checked
element by element against the expected result, then `warmup` untimed and `iters` timed runs
back to back; each rank reports its own time per operation, the report averages them over the
group (nccl-tests' default `-a 1`) and turns that into algorithm and bus bandwidth (busbw.py).
Groups: each node's ranks (intra), the ranks of one local index across nodes (inter), and all
ranks when those differ from both."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mshpc.parallel import comm
from mshpc.preflight.busbw import algbw_gbps, busbw_gbps
from mshpc.preflight.hostlist import compress
from mshpc.preflight.record import Record

ELEMENT_BYTES = 4  # float32, nccl-tests' default type


@dataclass(frozen=True)
class Group:
    name: str  # "n1", "local rank 0", "world"
    scope: str  # intra | inter | world
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    pg: dist.ProcessGroup | None  # None: the default group


def build_groups(node_of_rank: list[str]) -> list[Group]:
    """Collective over all ranks (every rank creates every group, in the same order)."""
    nodes = list(dict.fromkeys(node_of_rank))
    by_node = {node: tuple(r for r, n in enumerate(node_of_rank) if n == node) for node in nodes}
    local_index = {r: by_node[n].index(r) for r, n in enumerate(node_of_rank)}
    specs = [(node, "intra", ranks) for node, ranks in by_node.items() if len(ranks) > 1]
    for k in range(max(len(r) for r in by_node.values())):
        ranks = tuple(r for r in range(len(node_of_rank)) if local_index[r] == k)
        if len(ranks) > 1:
            specs.append((f"local rank {k}", "inter", ranks))
    if len(nodes) > 1 and len(node_of_rank) > len(nodes):
        specs.append(("world", "world", tuple(range(len(node_of_rank)))))
    whole = len(node_of_rank)
    return [Group(name, scope, ranks, None if len(ranks) == whole else dist.new_group(list(ranks)))
            for name, scope, ranks in specs]


def pattern(rank: int, numel: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """What group rank `rank` sends: small integers, so every sum is exact in float32."""
    return (rank + 1) + ((torch.arange(numel, device=device) + offset) % 7).float()


@dataclass(frozen=True)
class Op:
    run: Callable[[], object]  # one operation on the checked buffers
    expected: Callable[[], torch.Tensor]
    output: torch.Tensor
    timed: Callable[[], object]  # one operation on buffers whose values do not matter


def build_op(op: str, size_bytes: int, group: Group, rank: int, device: torch.device) -> tuple[Op, int]:
    """The operation `op` at nccl-tests' `size_bytes` on this rank, and the size it really moves."""
    n, g = len(group.ranks), group.ranks.index(rank)
    pg = group.pg
    m = max(1, size_bytes // ELEMENT_BYTES // (1 if op in ("all_reduce", "sendrecv") else n))
    if op == "all_reduce":
        buf, spare = pattern(g, m, device), torch.zeros(m, device=device)
        total = sum((pattern(j, m, device) for j in range(n)), torch.zeros(m, device=device))
        return Op(lambda: comm.all_reduce(buf, pg), lambda: total, buf, lambda: comm.all_reduce(spare, pg)), m * 4
    if op == "sendrecv":
        nxt, prev = group.ranks[(g + 1) % n], group.ranks[(g - 1) % n]
        send, recv, spare = pattern(g, m, device), torch.empty(m, device=device), torch.zeros(m, device=device)
        sink = torch.empty_like(spare)
        return Op(lambda: comm.exchange([(send, nxt)], [(recv, prev)]), lambda: pattern((g - 1) % n, m, device),
                  recv, lambda: comm.exchange([(spare, nxt)], [(sink, prev)])), m * 4
    if op == "all_gather":
        inp, out = pattern(g, m, device), torch.empty(n * m, device=device)
        return Op(lambda: comm.all_gather(out, inp, pg), lambda: torch.cat([pattern(j, m, device) for j in range(n)]),
                  out, lambda: comm.all_gather(out, inp, pg)), n * m * 4
    inp, out = pattern(g, n * m, device), torch.empty(m, device=device)
    if op == "reduce_scatter":
        total = sum((pattern(j, m, device, offset=g * m) for j in range(n)), torch.zeros(m, device=device))
        return Op(lambda: comm.reduce_scatter(out, inp, pg), lambda: total, out,
                  lambda: comm.reduce_scatter(out, inp, pg)), n * m * 4
    assert op == "all_to_all", op
    out = torch.empty(n * m, device=device)
    chunks = [pattern(j, m, device, offset=g * m) for j in range(n)]  # chunk g of every rank's input
    return Op(lambda: comm.all_to_all(out, inp, pg), lambda: torch.cat(chunks), out,
              lambda: comm.all_to_all(out, inp, pg)), n * m * 4


def measure(op: Op, group: Group, sync: Callable[[], None], warmup: int, iters: int) -> tuple[float, int]:
    """Collective over `group`: (this rank's seconds per timed operation, wrong output elements)."""
    op.run()
    sync()
    wrong = int((op.output != op.expected()).sum())
    for _ in range(warmup):
        op.timed()
    sync()
    comm.barrier(group.pg)
    start = time.perf_counter()
    for _ in range(iters):
        op.timed()
    sync()
    return (time.perf_counter() - start) / iters, wrong


def _rank_ranges(ranks: list[int]) -> str:
    spans: list[str] = []
    start: int | None = ranks[0]
    for prev, cur in zip(ranks, [*ranks[1:], None], strict=True):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return "ranks " + ",".join(spans)


def collective_records(raw: list[dict], node_of_rank: list[str], kind_of_rank: list[str]) -> list[Record]:
    """Records from every rank's timings: per group, operation and size, the bus bandwidth of the
    time averaged over the group's ranks (the slowest rank in the detail); per group and
    operation, the wrong elements over all sizes, blamed on each rank that received them."""
    by_key: dict[tuple[str, str, int], list[dict]] = {}
    for r in raw:
        by_key.setdefault((r["group"], r["op"], r["size_bytes"]), []).append(r)
    records: list[Record] = []
    for (group, op, size), members in sorted(by_key.items()):
        members.sort(key=lambda r: r["rank"])
        ranks = [r["rank"] for r in members]
        scope, n = members[0]["scope"], len(members)
        time_s = statistics.mean(r["time_s"] for r in members)
        slowest = max(members, key=lambda r: r["time_s"])
        records.append(Record(
            _node(scope, group, ranks, node_of_rank), _rank_ranges(ranks), f"{scope}_{op}_busbw_gbps",
            busbw_gbps(op, size, time_s, n), "GB/s", kind=kind_of_rank[ranks[0]],
            scope="node" if scope == "intra" else "group", size_bytes=size,
            detail=f"algbw {algbw_gbps(size, time_s):.4g} GB/s, {time_s * 1e3:.3g} ms mean over {n} ranks, "
                   f"slowest rank {slowest['rank']} {slowest['time_s'] * 1e3:.3g} ms"))
    return records + _correctness(raw, node_of_rank, kind_of_rank)


def _node(scope: str, group: str, ranks: list[int], node_of_rank: list[str]) -> str:
    return group if scope == "intra" else compress(node_of_rank[r] for r in ranks)


def _correctness(raw: list[dict], node_of_rank: list[str], kind_of_rank: list[str]) -> list[Record]:
    by_key: dict[tuple[str, str], list[dict]] = {}
    for r in raw:
        by_key.setdefault((r["group"], r["op"]), []).append(r)
    records = []
    for (group, op), runs in sorted(by_key.items()):
        ranks = sorted({r["rank"] for r in runs})
        wrong = {rank: sum(r["wrong"] for r in runs if r["rank"] == rank) for rank in ranks}
        if not any(wrong.values()):
            records.append(Record(_node(runs[0]["scope"], group, ranks, node_of_rank), _rank_ranges(ranks),
                                  f"{op}_wrong_elements", 0.0, "", kind=kind_of_rank[ranks[0]], scope="group",
                                  detail=f"every size checked on every rank of {group}"))
        records += [Record(node_of_rank[rank], f"rank {rank}", f"{op}_wrong_elements", float(count), "", rank=rank,
                           kind=kind_of_rank[rank], detail=f"received in {group}")
                    for rank, count in wrong.items() if count]
    return records
