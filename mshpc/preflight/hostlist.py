"""Slurm's hostlist syntax: `n[1-3,5]` <-> n1 n2 n3 n5, with zero padding (`gpu[08-11]`) and
several bracket groups (`r[1-2]n[1-2]`), done in Python so that nothing here calls scontrol
(a Slurm prolog or HealthCheckProgram must not)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

from mshpc.errors import ConfigError

_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")


def _split_top(text: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ConfigError(f"hostlist {text!r}: brackets do not nest (write e.g. n[1-3,5])")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"hostlist {text!r}: unclosed '[' (write e.g. n[1-3,5])")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _range(text: str, spec: str) -> list[str]:
    lo, sep, hi = spec.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise ConfigError(f"hostlist {text!r}: {spec!r} is not a number or a range like 1-3")
    # the lower bound's width is the padding: [08-11] -> 08 09 10 11
    numbers = range(int(lo), int(hi or lo) + 1)
    if not numbers:
        raise ConfigError(f"hostlist {text!r}: range {spec!r} runs backwards")
    return [str(n).zfill(len(lo)) for n in numbers]


def _expand_item(text: str, item: str) -> list[str]:
    parts = re.split(r"\[([^\]]*)\]", item)  # literal, ranges, literal, ranges, ..., literal
    choices = [[p] if i % 2 == 0 else [x for spec in p.split(",") for x in _range(text, spec)]
               for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand(text: str) -> list[str]:
    """Every host of a hostlist, in order, without duplicates; whitespace also separates."""
    hosts: list[str] = []
    for chunk in text.split():
        for item in _split_top(chunk):
            hosts += _expand_item(text, item)
    return list(dict.fromkeys(hosts))


def _runs(numbers: list[int], width: int) -> str:
    spans = []
    for _, group in itertools.groupby(enumerate(numbers), key=lambda p: p[1] - p[0]):
        run = [n for _, n in group]
        lo, hi = str(run[0]).zfill(width), str(run[-1]).zfill(width)
        spans.append(lo if len(run) == 1 else f"{lo}-{hi}")
    return ",".join(spans)


def compress(hosts: Iterable[str]) -> str:
    """The shortest usual hostlist for `hosts`: one bracket group per prefix and padding,
    over the trailing number, sorted, e.g. ['n3', 'n1', 'n2', 'n5'] -> 'n[1-3,5]'."""
    groups: dict[tuple[str, int], set[int]] = {}
    plain: set[str] = set()
    for host in hosts:
        match = _TRAILING_NUMBER.match(host)
        if match is None:
            plain.add(host)
            continue
        prefix, digits = match.groups()
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        groups.setdefault((prefix, width), set()).add(int(digits))
    for (prefix, width) in [k for k in groups if k[1] == 0]:  # n10 joins n[08-09] as n[08-10]
        for n in list(groups[(prefix, width)]):
            if (prefix, len(str(n))) in groups:
                groups[(prefix, len(str(n)))].add(n)
                groups[(prefix, width)].discard(n)
    items = sorted(plain)
    for (prefix, width), numbers in sorted(groups.items()):
        if numbers:
            ordered = sorted(numbers)
            body = _runs(ordered, width)
            items.append(f"{prefix}{body}" if len(ordered) == 1 else f"{prefix}[{body}]")
    return ",".join(items)
