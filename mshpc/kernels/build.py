"""Build the csrc/ extension just in time with torch.utils.cpp_extension, into a cache that
later processes reuse, and load its operators (torch.ops.mshpc.*) into this process; a process
whose inputs are unchanged loads the kept library (library_cache) without cpp_extension.

`python -m mshpc.kernels.build` does the same ahead of time (a login node, a container build),
so that no training rank waits for a compiler.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mshpc.errors import KernelError
from mshpc.kernels import library_cache
from mshpc.kernels.build_lock import exclusive_build
from mshpc.kernels.library_cache import Recipe, cpu_features
from mshpc.regular_files import fd_path

log = logging.getLogger(__name__)

NAME = "mshpc_kernels"
CSRC = Path(__file__).resolve().parents[2] / "csrc"
# -march=native: the CPU twins vectorise for this machine's widest units; the cache key below
# includes the CPU's feature flags, so a node of another kind builds its own copy.
# -fno-trapping-math lets GCC if-convert float compares (clamps) inside `omp simd` loops, and
# -fno-math-errno turns sqrt into an instruction rather than a libm call that blocks vectors;
# the kernels never read traps or errno, and IEEE results are unchanged.
# The C++ standard is torch's (its headers need C++20).
CPU_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fopenmp"]
# No --use_fast_math: the kernels must match the references, and the optimizer's divisions and
# square roots with it would not be IEEE-rounded. The architecture is the visible device's.
CUDA_FLAGS = ["-O3"]


@dataclass(frozen=True)
class Loaded:
    """What load() found or built."""

    library: Path
    cuda: bool
    built_s: float  # seconds spent loading, a build included
    kept: bool  # loaded the kept library directly, without cpp_extension (library_cache)


def sources(cuda: bool) -> list[Path]:
    """The binding, the CPU twins, and with `cuda` the .cu kernels."""
    files = [CSRC / "binding" / "ops.cpp", *sorted((CSRC / "cpu").glob("*.cpp"))]
    return files + (sorted((CSRC / "cuda").glob("*.cu")) if cuda else [])


def recipe(cuda: bool) -> Recipe:
    """The kernels' recipe; every header under csrc/ is hashed, since any source may include it."""
    headers = sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".hpp"))
    return Recipe(NAME, tuple(sources(cuda)), tuple(headers),
                  tuple(CPU_FLAGS + (["-DMSHPC_WITH_CUDA"] if cuda else [])), ("-fopenmp",),
                  tuple(CUDA_FLAGS), cuda, cache_root())


def cache_root() -> Path:
    """.cache/mshpc/kernels in the source checkout (git-ignored); ~/.cache/mshpc/kernels for an
    installed package, whose folder may not be writable."""
    checkout = CSRC.parent
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".cache" / "mshpc" / "kernels"
    return Path.home() / ".cache" / "mshpc" / "kernels"


def _toolchain() -> str:
    """The first line of `ninja --version` and `c++ --version`: ninja tracks the commands it ran,
    not the tools, and two ninja versions (a venv's and the system's) read each other's logs as
    changed commands, so each would rebuild everything the other built."""
    lines = []
    for tool in ("ninja", "c++"):
        try:
            out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        lines.append(out.strip().splitlines()[0] if out.strip() else f"{tool}: none")
    return " | ".join(lines)


def build_dir(spec: Recipe) -> Path:
    """One folder per torch build, CUDA or not, CPU kind and toolchain: nothing built for one is
    loaded by another. torch's own hash of the sources and flags inside decides when to rebuild."""
    identity = f"{torch.__version__}|{torch.version.cuda}|{spec.with_cuda}|{cpu_features()}|{_toolchain()}"
    key = hashlib.sha256(identity.encode())
    tag = f"torch{torch.__version__.split('+')[0]}-{'cuda' if spec.with_cuda else 'cpu'}-{key.hexdigest()[:12]}"
    return spec.cache_dir / tag


def want_cuda() -> bool:
    """Build the CUDA kernels where torch has CUDA and a device is visible."""
    return torch.version.cuda is not None and torch.cuda.is_available()


def _compile(spec: Recipe, verbose: bool) -> Path:
    """Build (ninja decides what is out of date) and load the library with cpp_extension."""
    from torch.utils import cpp_extension

    if spec.with_cuda and cpp_extension.CUDA_HOME is None:
        raise KernelError("the CUDA kernels need nvcc, and no CUDA toolkit was found (set CUDA_HOME)")
    if shutil.which("ninja") is None:  # torch runs it from PATH, even for a cached build
        raise KernelError("ninja is not on PATH (pip's ninja is in the venv: activate it, or "
                          "install ninja-build)")
    library_cache.private_folder(spec.cache_dir)
    folder = library_cache.private_folder(build_dir(spec))
    try:
        with exclusive_build(folder):  # no wait on the baton of a builder that died
            path = cpp_extension.load(
                name=spec.name, sources=[str(s) for s in spec.sources], build_directory=str(folder),
                extra_cflags=list(spec.cflags), extra_ldflags=list(spec.ldflags),
                extra_cuda_cflags=list(spec.cuda_cflags), with_cuda=spec.with_cuda, is_python_module=False,
                verbose=verbose)
    except (RuntimeError, OSError, ImportError) as exc:
        report = folder / "build-error.log"
        report.write_text(str(exc))
        raise KernelError(f"{_first_error(str(exc))} (full log: {report})") from None
    return Path(path)


def _first_error(text: str) -> str:
    """The compiler's first error line, or the message's first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and not line.startswith("Error building")]
    return (errors or lines or ["the build failed without output"])[0][:300]


def load_library(spec: Recipe, verbose: bool = False) -> tuple[Path, bool]:
    """Load the library kept for the recipe's key into this process if there is one, else build
    it with cpp_extension and keep it; returns its path and whether the kept one was loaded.
    Call it once per process and recipe: the kept copy is another file than the built one, and
    loading both would register the operators twice."""
    before = library_cache.key(spec)
    kept = library_cache.kept_path(spec, before)
    fd = library_cache.open_kept(kept)  # a KernelError for one another user could have written
    if fd is not None:
        try:
            torch.ops.load_library(fd_path(fd))
            return kept, True
        except OSError as exc:  # a kept file damaged since (it is renamed into place whole): rebuild
            log.warning("kernel library %s does not load (%s); building again", kept, exc)
        finally:
            os.close(fd)
    built = _compile(spec, verbose)
    # Kept only if no input changed during the build, so the key names what was built.
    if library_cache.key(spec) == before:
        try:
            library_cache.keep(built, spec, before)
        except OSError as exc:  # the library is loaded; only the next process's shortcut is lost
            log.warning("kernel library built but not kept at %s: %s", library_cache.kept_path(spec, before), exc)
    return built, False


# The library loaded into this process, per kind: a second load of it would register twice.
_LOADED: dict[bool, Loaded] = {}


def load(verbose: bool = False) -> Loaded:
    """Build (or reuse the kept build of) the extension and load its operators and their Python
    registrations (fake and autograd) into this process, once. Raises KernelError, one line,
    when it cannot."""
    from mshpc.kernels import ops

    cuda = want_cuda()
    if cuda not in _LOADED:
        if not (CSRC / "mshpc_kernels.h").is_file():
            raise KernelError(f"the kernel sources are not at {CSRC} (a non-editable install leaves csrc/ "
                              "out: install the checkout with pip install -e)")
        start = time.perf_counter()
        library, kept = load_library(recipe(cuda), verbose)
        ops.register()
        _LOADED[cuda] = Loaded(library, cuda, time.perf_counter() - start, kept)
    return _LOADED[cuda]


def main(argv: list[str] | None = None) -> int:
    """`python -m mshpc.kernels.build`: build ahead of time into the cache and say where."""
    parser = argparse.ArgumentParser(prog="python -m mshpc.kernels.build", description=main.__doc__)
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    try:
        loaded = load(verbose=args.verbose)
    except KernelError as exc:
        print(f"mshpc: error: KernelError: {exc}")
        return 2
    kind = "CUDA kernels and CPU twins" if loaded.cuda else "CPU twins (no CUDA device or torch without CUDA)"
    print(f"mshpc: fused kernels ready in {loaded.built_s:.1f} s: {kind}: {loaded.library}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
