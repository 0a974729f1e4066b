"""Build the csrc/ extension just in time with torch.utils.cpp_extension, into a cache that
later processes reuse, and load its operators (torch.ops.mshpc.*) into this process.

`python -m mshpc.kernels.build` does the same ahead of time (a login node, a container build),
so that no training rank waits for a compiler.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mshpc.errors import KernelError

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
    built_s: float  # seconds spent loading, a build included (cache hits take about one)


def sources(cuda: bool) -> list[Path]:
    """The binding, the CPU twins, and with `cuda` the .cu kernels."""
    files = [CSRC / "binding" / "ops.cpp", *sorted((CSRC / "cpu").glob("*.cpp"))]
    return files + (sorted((CSRC / "cuda").glob("*.cu")) if cuda else [])


def cache_root() -> Path:
    """.cache/mshpc/kernels in the source checkout (git-ignored); ~/.cache/mshpc/kernels for an
    installed package, whose folder may not be writable."""
    checkout = CSRC.parent
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".cache" / "mshpc" / "kernels"
    return Path.home() / ".cache" / "mshpc" / "kernels"


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


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


def build_dir(cuda: bool) -> Path:
    """One folder per torch build, CUDA or not, CPU kind and toolchain: nothing built for one is
    loaded by another. torch's own hash of the sources and flags inside decides when to rebuild."""
    identity = f"{torch.__version__}|{torch.version.cuda}|{cuda}|{_cpu_features()}|{_toolchain()}"
    key = hashlib.sha256(identity.encode())
    tag = f"torch{torch.__version__.split('+')[0]}-{'cuda' if cuda else 'cpu'}-{key.hexdigest()[:12]}"
    return cache_root() / tag


def want_cuda() -> bool:
    """Build the CUDA kernels where torch has CUDA and a device is visible."""
    return torch.version.cuda is not None and torch.cuda.is_available()


def _compile(cuda: bool, verbose: bool) -> Path:
    from torch.utils import cpp_extension

    if not (CSRC / "mshpc_kernels.h").is_file():
        raise KernelError(f"the kernel sources are not at {CSRC} (a non-editable install leaves csrc/ "
                          "out: install the checkout with pip install -e)")
    if cuda and cpp_extension.CUDA_HOME is None:
        raise KernelError("the CUDA kernels need nvcc, and no CUDA toolkit was found (set CUDA_HOME)")
    if shutil.which("ninja") is None:  # torch runs it from PATH, even for a cached build
        raise KernelError("ninja is not on PATH (pip's ninja is in the venv: activate it, or "
                          "install ninja-build)")
    folder = build_dir(cuda)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        path = cpp_extension.load(
            name=NAME, sources=[str(s) for s in sources(cuda)], build_directory=str(folder),
            extra_cflags=CPU_FLAGS + (["-DMSHPC_WITH_CUDA"] if cuda else []), extra_ldflags=["-fopenmp"],
            extra_cuda_cflags=CUDA_FLAGS, with_cuda=cuda, is_python_module=False, verbose=verbose)
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


def load(verbose: bool = False) -> Loaded:
    """Build (or reuse the cached build of) the extension and load its operators and their Python
    registrations (fake and autograd) into this process. Raises KernelError, one line, when it
    cannot."""
    from mshpc.kernels import ops

    cuda = want_cuda()
    start = time.perf_counter()
    library = _compile(cuda, verbose)
    ops.register()
    return Loaded(library, cuda, time.perf_counter() - start)


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
