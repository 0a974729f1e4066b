"""Pairwise node tests that locate a slow node or link instead of reporting a slow average.

Nodes are paired in rounds (every pair when there are few nodes, by the circle method; random
bisections when there are many); in a round each pair exchanges messages both ways at once,
local rank k with local rank k (on GPU nodes, one NIC rail each). A node whose pairs are all
slow has a bad link of its own: its `link_gbps` (the median of its pairs) fails the fleet rule.
A slow pair between two good nodes is a bad link between them, blamed on both. Either is
measured again before it excludes anyone (confirm.py): each pair keeps all its samples."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable

import torch

from mshpc.parallel import comm
from mshpc.preflight.collectives import pattern
from mshpc.preflight.record import Record, first
from mshpc.preflight.thresholds import Rule, failed_samples


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


def disjoint_rounds(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`pairs` in rounds where no node is in two pairs, each pair in the first round it fits."""
    rounds: list[list[tuple[int, int]]] = []
    for pair in pairs:
        for r in rounds:
            if not {x for p in r for x in p} & set(pair):
                r.append(pair)
                break
        else:
            rounds.append([pair])
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


def pair_samples(raw: list[dict]) -> dict[tuple[str, str], list[float]]:
    """Each node pair's samples in the order taken (the first round, then re-measurements): the
    slowest rail of each, as either end saw it."""
    by_sample: dict[tuple[str, str], dict[int, float]] = {}
    for r in raw:
        taken = by_sample.setdefault((r["a"], r["b"]), {})
        j = r.get("sample", 0)
        taken[j] = min(taken.get(j, r["gbps"]), r["gbps"])
    return {pair: [taken[j] for j in sorted(taken)] for pair, taken in by_sample.items()}


def link_records(raw: list[dict], kind_of_node: dict[str, str]) -> list[Record]:
    """Per node: link_gbps, the median of its pairs (judged later by the fleet rule), one sample
    per round its pairs were all measured in; per pair: pair_gbps (judged by judge_pairs once the
    nodes are); each the best of its samples. Wrong data: a failure of both ends."""
    pairs = pair_samples(raw)
    size = raw[0]["size_bytes"] if raw else None
    records = []
    for node in sorted({n for pair in pairs for n in pair}):
        mine = [samples for pair, samples in pairs.items() if node in pair]
        rounds = [statistics.median(samples[j] for samples in mine) for j in range(min(map(len, mine)))]
        records.append(Record(node, "network", "link_gbps", max(rounds), "GB/s", kind=kind_of_node[node],
                              scope="link", size_bytes=size, detail=f"median of {len(mine)} pairs, each way",
                              samples=rounds))
    for (a, b), samples in sorted(pairs.items()):
        records.append(Record(a, f"{a}<->{b}", "pair_gbps", max(samples), "GB/s", kind=kind_of_node[a], scope="link",
                              size_bytes=size, detail="slowest rail, each way", samples=samples))
    for r in raw:
        if r["wrong"]:
            for node in (r["a"], r["b"]):
                records.append(Record(node, f"{r['a']}<->{r['b']}", "pair_wrong_elements", float(r["wrong"]), "",
                                      kind=kind_of_node[node], rank=r["rank"], scope="link"))
    return records


def judge_pairs(records: list[Record], fleet: Rule | None) -> list[Record]:
    """Pair records, judged against the median of the nodes' link_gbps: a slow pair is blamed
    on the end(s) whose link fails, else on the end(s) failing a device or node test, else on
    both ends (the link between them)."""
    links = {r.node: r for r in records if r.test == "link_gbps"}
    if fleet is None or fleet.fail is None or not links:
        return records
    median = statistics.median(first(r) for r in links.values() if r.value is not None)  # as verdict._fleet
    limit = f"fail < {fleet.fail:g} x median {median:.4g} (of the nodes' link_gbps)"
    out = [r for r in records if r.test != "pair_gbps"]
    failing = {r.node for r in out if r.status == "fail" and r.scope in ("device", "node")}
    for r in (r for r in records if r.test == "pair_gbps"):
        a, b = r.device.split("<->")
        r = dataclasses.replace(r, threshold=limit, failed=failed_samples(r.samples, fleet.fail * median, "higher"))
        if r.value is not None and r.value >= fleet.fail * median:
            out.append(dataclasses.replace(r, status="pass"))
            continue
        bad_link = [n for n in (a, b) if links[n].status == "fail"]
        # a node failing another test will be left out anyway: the pair says nothing of its partner
        bad_node = [n for n in (a, b) if n in failing]
        why = ("slow because this node's link is" if bad_link else "slow at a node that fails another test"
               if bad_node else "slow between two good nodes: the link itself")
        out += [dataclasses.replace(r, node=n, status="fail", detail=why) for n in (bad_link or bad_node or [a, b])]
    return out

