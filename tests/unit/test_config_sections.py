"""Each part takes only its config section(s), never the whole `Config` (STYLE.md 3; issue #40).

Below the entry points no function, method or dataclass field accepts `mshpc.config.Config`: a
reader learns what a part depends on from its signature, as in torchtitan's
`parallelize(model, mesh, *, parallel, train, model_cfg, optim)`. Allowed to hold it whole:
- `config.py`: it defines, loads, validates and hashes the tree;
- `train.py`, `cli.py`, `__main__.py`: the entry points, which hand each part its sections;
- `launch/submit.py`: `mshpc.submit(config)` is the Python API's `mshpc train CONFIG`; it takes
  the user's config whole and writes it as the YAML every task of the job reads.
A module may still load a run's config.yaml (diagnose, export, generate) and pass sections on.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from mshpc import config

PACKAGE = Path(config.__file__).parent
ENTRY_POINTS = {"config.py", "train.py", "cli.py", "__main__.py", "launch/submit.py"}


def _config_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names this module binds to `Config` itself, and to the module `mshpc.config`."""
    names, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "mshpc.config":
            names |= {a.asname or a.name for a in node.names if a.name == "Config"}
        elif isinstance(node, ast.ImportFrom) and node.module == "mshpc":
            modules |= {a.asname or a.name for a in node.names if a.name == "config"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "mshpc.config" and a.asname}
    return names, modules


def _names_config(annotation: ast.expr | None, names: set[str], modules: set[str]) -> bool:
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted "Config"
            if _names_config(ast.parse(node.value, mode="eval").body, names, modules):
                return True
        elif isinstance(node, ast.Name) and node.id in names:
            return True
        if (isinstance(node, ast.Attribute) and node.attr == "Config" and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            return True
    return False


def whole_config_parameters(source: str) -> list[str]:
    """Where `source` accepts the whole Config: parameters and class fields annotated with it
    (alone or inside another type), and parameters named cfg with no annotation to say which."""
    tree = ast.parse(source)
    names, modules = _config_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]:
                if _names_config(arg.annotation, names, modules) or (arg.arg == "cfg" and arg.annotation is None):
                    found.append(f"line {arg.lineno}: parameter {arg.arg}")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and _names_config(item.annotation, names, modules):
                    found.append(f"line {item.lineno}: field {ast.unparse(item.target)} of {node.name}")
    return found


def test_the_check_finds_a_whole_config_however_it_is_spelled():
    source = '''
from mshpc.config import Config as C, ModelConfig
import mshpc.config as mc
def a(model_cfg: ModelConfig, *, cfg: C): ...
def b(x, configs: list["C"]) -> None: ...
def c(f: Callable[[mc.Config], int]): ...
class D:
    whole: C | None
    model: ModelConfig
e = lambda cfg: cfg.model
'''
    assert whole_config_parameters(source) == [
        "line 4: parameter cfg", "line 5: parameter configs", "line 6: parameter f", "line 8: field whole of D",
        "line 10: parameter cfg"]


def test_no_module_below_the_entry_points_accepts_the_whole_config():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name not in ENTRY_POINTS and (where := whole_config_parameters(path.read_text())):
            found[name] = where
    assert not found, f"these take the whole Config; give them their sections: {found}"


def test_every_bounded_field_says_its_default_by_keyword():
    with pytest.raises(TypeError):
        config.at_least(1, 4)  # type: ignore[misc]  # which is the bound, which the default?
    bounded = config.at_least(1, default=4)
    assert (bounded.default, bounded.metadata["min"]) == (4, 1)
    assert config.ParallelConfig().tp_overlap_chunks == 2
    field = {f.name: f for f in dataclasses.fields(config.ParallelConfig)}["tp_overlap_chunks"]
    assert field.metadata["min"] == 1
