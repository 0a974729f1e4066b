import warnings
from pathlib import Path

import pytest

from mshpc.errors import KernelError
from mshpc.kernels import build


@pytest.fixture(scope="session", autouse=True)
def fused_kernels_built() -> None:
    """Build the fused kernels (csrc/) once, before any test: otherwise the first model a test
    makes compiles them, perhaps inside a timed multi-rank test. Later sessions load the cache.
    A failure is the kernel tests' to report; the rest run on the fallback (fused_kernels=auto)."""
    try:
        build.load()
    except KernelError as exc:
        warnings.warn(f"fused kernels unavailable, tests use the reference operators: {exc}")


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    """One cache folder for the embedded default corpus, prepared by the first run that needs it."""
    return tmp_path_factory.mktemp("corpus-cache")
