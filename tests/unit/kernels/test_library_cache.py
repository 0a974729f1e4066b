"""The kept kernel library: loaded directly when nothing changed, rebuilt (never loaded stale) when
a source, a header or a flag did. A one-function C++ library stands in for csrc/ so that each
build takes a moment; it goes through the same build.load_library as the kernels."""

import ctypes
import subprocess
import sys
from pathlib import Path

from torch.utils import cpp_extension

from mshpc.kernels import build, library_cache
from mshpc.kernels.library_cache import Recipe

REPO = Path(__file__).resolve().parents[3]


def probe_recipe(tmp_path: Path, cflags: tuple[str, ...] = ("-O1",)) -> Recipe:
    return Recipe("mshpc_probe", (tmp_path / "probe.cpp",), (tmp_path / "probe.h",), cflags, (), (),
                  False, tmp_path / "cache")


def write_probe(tmp_path: Path, value: int, offset: int = 0) -> None:
    (tmp_path / "probe.h").write_text(f"#define PROBE_OFFSET {offset}\n")
    (tmp_path / "probe.cpp").write_text(
        f'#include "probe.h"\nextern "C" int mshpc_probe() {{ return {value} + PROBE_OFFSET; }}\n')


def probe_value(library: Path) -> int:
    return ctypes.CDLL(str(library)).mshpc_probe()


def load_as_a_new_process(recipe: Recipe) -> tuple[Path, bool]:
    """build.load_library as a rank's first call: torch remembers each extension's source hash per
    process and skips ninja when only a header changed; a rank starts without that memory."""
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(recipe.name, None)
    return build.load_library(recipe)


def test_unchanged_inputs_load_the_kept_library_and_changed_ones_rebuild(tmp_path: Path) -> None:
    write_probe(tmp_path, 1)
    first, kept = load_as_a_new_process(probe_recipe(tmp_path))
    assert not kept
    again, kept = load_as_a_new_process(probe_recipe(tmp_path))
    assert kept and probe_value(again) == 1

    write_probe(tmp_path, 2)  # a source changes: built again, and the new value is what loads
    built, kept = load_as_a_new_process(probe_recipe(tmp_path))
    assert not kept
    changed, kept = load_as_a_new_process(probe_recipe(tmp_path))
    assert kept and changed != again and probe_value(changed) == 2

    write_probe(tmp_path, 2, offset=40)  # only the header changes
    _, kept = load_as_a_new_process(probe_recipe(tmp_path))
    assert not kept
    header_changed, kept = load_as_a_new_process(probe_recipe(tmp_path))
    assert kept and probe_value(header_changed) == 42

    _, kept = load_as_a_new_process(probe_recipe(tmp_path, cflags=("-O2",)))  # a flag changes
    assert not kept

    write_probe(tmp_path, 1)  # back to the first sources: their own kept library, not the last build
    back, kept = load_as_a_new_process(probe_recipe(tmp_path))
    assert kept and back == again and probe_value(back) == 1


def test_the_key_covers_every_input_the_binary_depends_on(tmp_path: Path) -> None:
    write_probe(tmp_path, 1)
    base = library_cache.key(probe_recipe(tmp_path))
    assert library_cache.key(probe_recipe(tmp_path)) == base
    assert library_cache.key(probe_recipe(tmp_path, cflags=("-O1", "-DX"))) != base
    kernels = build.recipe(cuda=False)
    # Every header under csrc/ is hashed, the CUDA ones included (a .cpp may include them).
    assert {p.name for p in kernels.headers} >= {"mshpc_kernels.h", "dtype.cuh"}


def test_a_rank_loads_the_kernels_without_cpp_extension() -> None:
    """What each rank gains: no setuptools import, no ninja or compiler run, once the session's
    first load (tests/conftest.py) has kept the library."""
    code = ("import sys; from mshpc.kernels import build; loaded = build.load(); "
            "print(loaded.kept, 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         check=True).stdout.split()
    assert out == ["True", "False"]
