"""The kept kernel library is loaded only when no other user could have written it (issue #43,
finding 8): a library another user owns, or one any other user may write, in the cache is not
loaded (its constructor never runs), and nothing is built into a folder others may write."""

import os
import subprocess
from pathlib import Path

import pytest
from support.other_user import NOBODY, needs_root
from torch.utils import cpp_extension

from mshpc.errors import KernelError
from mshpc.kernels import build, library_cache
from mshpc.kernels.library_cache import Recipe


def probe_recipe(tmp_path: Path) -> Recipe:
    """A one-function library standing in for csrc/, as tests/unit/kernels/test_library_cache.py builds it."""
    return Recipe("mshpc_trust_probe", (tmp_path / "probe.cpp",), (), ("-O1",), (), (), False, tmp_path / "cache")


def write_probe(tmp_path: Path, value: int) -> None:
    (tmp_path / "probe.cpp").write_text(f'extern "C" int mshpc_probe() {{ return {value}; }}\n')


def load_as_a_new_process(recipe: Recipe) -> tuple[Path, bool]:
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(recipe.name, None)
    return build.load_library(recipe)


def planted(tmp_path: Path, target: Path) -> Path:
    """A library whose constructor leaves a marker file, built over `target`; the marker's path."""
    marker = tmp_path / "constructor-ran"
    source = tmp_path / "evil.c"
    source.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{ '
                      f'FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\nint mshpc_probe(void) {{ return 666; }}\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(target), str(source)], check=True)
    return marker


def kept(tmp_path: Path) -> Path:
    write_probe(tmp_path, 1)
    recipe = probe_recipe(tmp_path)
    load_as_a_new_process(recipe)  # builds and keeps it
    return library_cache.kept_path(recipe, library_cache.key(recipe))


@needs_root
def test_a_kept_library_another_user_owns_is_not_loaded(tmp_path):
    path = kept(tmp_path)
    marker = planted(tmp_path, path)
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o755)
    with pytest.raises(KernelError, match=f"not loaded: owned by uid {NOBODY}, not this user"):
        load_as_a_new_process(probe_recipe(tmp_path))
    assert not marker.exists()


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "symlink"])
def test_a_kept_library_others_may_write_or_a_link_is_not_loaded(tmp_path, how):
    path = kept(tmp_path)
    marker = planted(tmp_path, path)
    if how == "symlink":
        os.rename(path, tmp_path / "elsewhere.so")
        path.symlink_to(tmp_path / "elsewhere.so")
    else:
        os.chmod(path, 0o775 if how == "group-writable" else 0o757)
    why = "a symbolic link" if how == "symlink" else "writable by others"
    with pytest.raises(KernelError, match=f"kept kernel library {path}: not loaded: {why}"):
        load_as_a_new_process(probe_recipe(tmp_path))
    assert not marker.exists()


def test_nothing_is_built_in_a_folder_others_may_write(tmp_path):
    write_probe(tmp_path, 1)
    recipe = probe_recipe(tmp_path)
    recipe.cache_dir.mkdir()
    os.chmod(recipe.cache_dir, 0o777)
    with pytest.raises(KernelError, match=r"kernel build folder .*cache: writable by others \(mode 777\)"):
        load_as_a_new_process(recipe)
    assert list(recipe.cache_dir.iterdir()) == []
    os.chmod(recipe.cache_dir, 0o755)  # its owner's alone: built, kept (not writable by others), loaded
    load_as_a_new_process(recipe)
    path = library_cache.kept_path(recipe, library_cache.key(recipe))
    assert os.stat(path).st_mode & 0o777 == 0o755
    assert load_as_a_new_process(recipe)[1]
