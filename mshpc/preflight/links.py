"""Pairwise node tests that locate a slow node or link instead of reporting a slow average.

Nodes are paired in rounds (every pair when there are few nodes, by the circle method; random
bisections when there are many); in a round each pair exchanges messages both ways at once,
local rank k with local rank k (on GPU nodes, one NIC rail each). A node whose pairs are all
slow has a bad link of its own: its `link_gbps` (the median of its pairs) fails the fleet rule.
A slow pair between two good nodes is a bad link between them, blamed on both."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable

import torch

from mshpc.parallel import comm
from mshpc.preflight.collectives import pattern
from mshpc.preflight.record import Record
from mshpc.preflight.thresholds import Rule


def schedule(n: int, max_nodes: int, bisections: int, seed: int = 0) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint node pairs: all n(n-1)/2 pairs when n <= max_nodes, else `bisections`
    random perfect matchings (each splits the nodes in halves and pairs across)."""
    if n <= max_nodes:
        ring: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
        rounds = []
        for _ in range(len(ring) - 1):
            half = len(ring) // 2
            pairs = [(ring[i], ring[-1 - i]) for i in range(half)]
            rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
            ring = [ring[0], ring[-1], *ring[1:-1]]  # circle method: fix one, rotate the rest
        return rounds
    rng = random.Random(seed)  # the same on every rank
    rounds = []
    for _ in range(bisections):
        order = rng.sample(range(n), n)
        # strict=False: with an odd n the last node drawn sits this round out
        rounds.append([(min(a, b), max(a, b)) for a, b in zip(order[0::2], order[1::2], strict=False)])
    return rounds


def my_peer(round_pairs: list[tuple[int, int]], by_node: list[tuple[int, ...]],
            rank: int) -> tuple[int, int, int] | None:
    """(peer rank, node index a, node index b) for this rank in this round, or None."""
    for a, b in round_pairs:
        for k in range(min(len(by_node[a]), len(by_node[b]))):
            if rank in (by_node[a][k], by_node[b][k]):
                return (by_node[b][k] if rank == by_node[a][k] else by_node[a][k]), a, b
    return None


def exchange_gbps(rank: int, peer: int, numel: int, device: torch.device, sync: Callable[[], None],
                  warmup: int, iters: int) -> tuple[float, int]:
    """Point to point with `peer`, both ways at once: (GB/s each way, wrong elements received)."""
    send, recv = pattern(rank, numel, device), torch.empty(numel, device=device)
    comm.exchange([(send, peer)], [(recv, peer)])
    sync()
    wrong = int((recv != pattern(peer, numel, device)).sum())
    for _ in range(warmup):
        comm.exchange([(send, peer)], [(recv, peer)])
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        comm.exchange([(send, peer)], [(recv, peer)])
    sync()
    return numel * 4 * iters / (time.perf_counter() - start) / 1e9, wrong


def pair_values(raw: list[dict]) -> dict[tuple[str, str], float]:
    """Each node pair's bandwidth: the slowest rail, as either end saw it."""
    values: dict[tuple[str, str], float] = {}
    for r in raw:
        key = (r["a"], r["b"])
        values[key] = min(values.get(key, r["gbps"]), r["gbps"])
    return values


def link_records(raw: list[dict], kind_of_node: dict[str, str]) -> list[Record]:
    """Per node: link_gbps, the median of its pairs (judged later by the fleet rule); per pair:
    pair_gbps (judged by judge_pairs once the nodes are); wrong data: a failure of both ends."""
    pairs = pair_values(raw)
    size = raw[0]["size_bytes"] if raw else None
    records = []
    for node in sorted({n for pair in pairs for n in pair}):
        mine = [v for pair, v in pairs.items() if node in pair]
        records.append(Record(node, "network", "link_gbps", statistics.median(mine), "GB/s", kind=kind_of_node[node],
                              scope="link", size_bytes=size, detail=f"median of {len(mine)} pairs, each way"))
    for (a, b), value in sorted(pairs.items()):
        records.append(Record(a, f"{a}<->{b}", "pair_gbps", value, "GB/s", kind=kind_of_node[a], scope="link",
                              size_bytes=size, detail="slowest rail, each way"))
    for r in raw:
        if r["wrong"]:
            for node in (r["a"], r["b"]):
                records.append(Record(node, f"{r['a']}<->{r['b']}", "pair_wrong_elements", float(r["wrong"]), "",
                                      kind=kind_of_node[node], rank=r["rank"], scope="link"))
    return records


def judge_pairs(records: list[Record], fleet: Rule | None) -> list[Record]:
    """Pair records, judged against the median of the nodes' link_gbps: a slow pair is blamed
    on its failed end(s), or on both ends when neither failed (the link between them)."""
    links = {r.node: r for r in records if r.test == "link_gbps"}
    if fleet is None or fleet.fail is None or not links:
        return records
    median = statistics.median(r.value for r in links.values() if r.value is not None)
    limit = f"fail < {fleet.fail:g} x median {median:.4g} (of the nodes' link_gbps)"
    out = [r for r in records if r.test != "pair_gbps"]
    for r in (r for r in records if r.test == "pair_gbps"):
        a, b = r.device.split("<->")
        if r.value is not None and r.value >= fleet.fail * median:
            out.append(dataclasses.replace(r, status="pass", threshold=limit))
            continue
        failed = [n for n in (a, b) if links[n].status == "fail"]
        why = "slow because this node's link is" if failed else "slow between two good nodes: the link itself"
        out += [dataclasses.replace(r, node=n, status="fail", threshold=limit, detail=why) for n in (failed or [a, b])]
    return out

