"""No module of mshpc/ imports from a layer above its own: the layers are the `## Layers` block of
docs/DESIGN.md, bottom first; every import (module level or inside a function) is walked with
`ast`, so a lazy import cannot hide an upward dependency."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "mshpc"


def parse_layers(design: str) -> list[list[str]]:
    """The names on each line of the first fenced block under `## Layers`, bottom layer first."""
    section = design.split("## Layers", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, "docs/DESIGN.md: no fenced block under ## Layers"
    lines = (line.split("#", 1)[0].split() for line in block.group(1).splitlines())
    return [names for names in lines if names]


def module_name(path: Path) -> str:
    """`mshpc/parallel/mesh.py` -> mshpc.parallel.mesh; a package's __init__ keeps its name."""
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The mshpc module that `name` (dotted) refers to: itself, or its package's __init__."""
    if name in MODULES:
        return name
    return name + ".__init__" if name + ".__init__" in MODULES else None


def imported(module: str, tree: ast.AST) -> set[str]:
    """Every mshpc module `module` imports, at any depth of its code."""
    package = module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package, up level - 1
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from a.b import c` imports module a.b.c when there is one, else a name of a.b
            out.update(f"{base}.{a.name}" if resolve(f"{base}.{a.name}") else base for a in node.names)
    return {r for r in map(resolve, out) if r is not None and r != module}


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """Index of the layer whose name is `module` or the longest package above it."""
    best: tuple[int, int] | None = None  # (length of the name, layer)
    for index, names in enumerate(layers):
        for name in names:
            if module == name or module.startswith(name + "."):
                if best is None or len(name) > best[0]:
                    best = (len(name), index)
    return None if best is None else best[1]


def upward_imports(layers: list[list[str]]) -> list[str]:
    """One line per import from a lower layer into a higher one."""
    found = []
    for module, path in MODULES.items():
        mine = layer_of(module, layers)
        for target in sorted(imported(module, ast.parse(path.read_text(), str(path)))):
            theirs = layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{module} (layer {mine}: {' '.join(layers[mine])}) imports {target} "
                             f"(layer {theirs}: {' '.join(layers[theirs])})")
    return found


@pytest.fixture(scope="module")
def layers() -> list[list[str]]:
    return parse_layers((REPO / "docs/DESIGN.md").read_text())


def test_every_module_has_a_layer(layers):
    missing = [m for m in MODULES if layer_of(m, layers) is None]
    assert not missing, f"not in any layer of docs/DESIGN.md: {', '.join(missing)}"


def test_no_module_imports_from_a_layer_above(layers):
    found = upward_imports(layers)
    assert not found, "upward imports:\n" + "\n".join(found)


def test_an_upward_import_is_caught(layers):
    """The check itself: a kernel that imports the train loop is named, with both layers."""
    tree = ast.parse("def f():\n    from mshpc.train import train\n")
    targets = imported("mshpc.kernels.ops", tree)
    assert targets == {"mshpc.train"}
    assert layer_of("mshpc.train", layers) > layer_of("mshpc.kernels.ops", layers)
