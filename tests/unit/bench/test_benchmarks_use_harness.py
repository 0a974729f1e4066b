"""Every script under benchmarks/ runs on the shared harness: it imports mshpc.bench (rounds,
the paired interval, the JSON record, local ranks) as a package, and none edits sys.path."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = sorted((REPO / "benchmarks").rglob("*.py"))


def test_there_are_benchmarks_to_check():
    assert len(SCRIPTS) > 30


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_benchmark_imports_the_harness_and_leaves_sys_path_alone(script):
    tree = ast.parse(script.read_text(), str(script))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert any(m == "mshpc.bench" or m.startswith("mshpc.bench.") for m in imported), \
        f"{script.name} does not import mshpc.bench (the harness)"
    touches = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
               and isinstance(n.value, ast.Name) and n.value.id == "sys"]
    assert not touches, f"{script.name} uses sys.path on line {touches[0]}: import by package instead"
