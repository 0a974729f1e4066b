"""Built libraries kept under a key of everything that changes the binary, so that a process whose
sources, flags, torch, Python, CPU kind and toolchain are unchanged loads its library directly.

torch.utils.cpp_extension.load costs a rank about 0.2 CPU-s even when nothing changed (importing
it pulls in setuptools; it runs ninja and the compiler for their versions); a key of file
contents and stats costs a few milliseconds.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import stat
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from mshpc.errors import KernelError
from mshpc.regular_files import open_regular


@dataclass(frozen=True)
class Recipe:
    """What to build: the extension's name, its sources, every file they include (hashed with
    them: a changed header changes the binary too), the flags, and where builds go."""

    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...]
    with_cuda: bool
    cache_dir: Path


def cpu_features() -> str:
    """The CPU's feature flags: -march=native builds for them."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return line.strip()
    except OSError:
        pass
    return platform.processor()


def tool_identity(tool: str) -> str:
    """Where `tool` resolves on PATH and its file's size and time: an upgraded compiler is another
    file, and stat-ing it is cheap where running `--version` at every rank's start is not."""
    found = shutil.which(tool)
    if found is None:
        return f"{tool}: none"
    real = os.path.realpath(found)
    stat = os.stat(real)
    return f"{tool}: {real} {stat.st_size} {stat.st_mtime_ns}"


def _environment(recipe: Recipe) -> list[str]:
    """Everything outside the recipe's files that the binary depends on."""
    parts = [torch.__version__, str(torch.version.git_version), str(torch.version.cuda),
             sys.implementation.cache_tag, str(sysconfig.get_config_var("SOABI")), platform.machine(),
             cpu_features(), tool_identity("c++"), tool_identity("ninja")]
    if recipe.with_cuda:  # nvcc builds for the visible device's architecture
        parts += [tool_identity("nvcc"), str(torch.cuda.get_device_capability())]
    return parts


def key(recipe: Recipe) -> str:
    """sha256 of the recipe (name, flags, each file's name and content) and its environment."""
    digest = hashlib.sha256()
    for part in [recipe.name, *recipe.cflags, "|", *recipe.ldflags, "|", *recipe.cuda_cflags,
                 str(recipe.with_cuda), *_environment(recipe)]:
        digest.update(part.encode() + b"\0")
    for path in (*recipe.sources, *recipe.headers):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def kept_path(recipe: Recipe, recipe_key: str) -> Path:
    """Where the library built for `recipe_key` is kept: its name holds the key, so a library is
    never replaced by another build, and a changed input finds no file rather than a stale one."""
    return recipe.cache_dir / "ready" / f"{recipe.name}-{recipe_key[:32]}.so"


def keep(built: Path, recipe: Recipe, recipe_key: str) -> Path:
    """Copy the library just built for `recipe_key` to its kept path (atomically: ranks that build
    at once each rename a whole copy, and a reader never sees half of one), writable by its owner
    alone, as `open_kept` requires."""
    target = kept_path(recipe, recipe_key)
    private_folder(target.parent)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        shutil.copyfile(built, partial)
        os.chmod(partial, 0o755)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _untrusted(st: os.stat_result) -> str | None:
    """Why a file or folder with status `st` may hold code another user chose, or None: owned by
    someone other than this user and root, or writable by anyone but its owner."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, not this user ({os.geteuid()}) or root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def open_kept(path: Path) -> int | None:
    """A descriptor of the kept library `path`, None when there is none. Loading a library runs its
    constructors in this process, so one is loaded only if it is a regular file (not through a
    link) owned by this user or root and writable by nobody else; otherwise a KernelError says why.
    Load it through `regular_files.fd_path`, so what loads is what was checked."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KernelError(f"kept kernel library {path}: not loaded: {exc.strerror}") from None
    why = _untrusted(os.fstat(fd))
    if why is not None:
        os.close(fd)
        raise KernelError(f"kept kernel library {path}: not loaded: {why}")
    return fd


def private_folder(path: Path) -> Path:
    """`path`, made if missing (only its owner may write it), refused with a KernelError if
    another user owns it or may write in it: what is built there is loaded into this process."""
    path.mkdir(parents=True, exist_ok=True, mode=0o755)
    why = _untrusted(os.stat(path))
    if why is not None:
        raise KernelError(f"kernel build folder {path}: {why}; nothing is built or loaded from it (chmod go-w it, or "
                          "remove it)")
    return path
