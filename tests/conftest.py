import os
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


@pytest.fixture
def dali() -> None:
    """DALI's CPU pipelines run here: `make test` installs nvidia-dali-cuda130. Skipped with the
    reason where it is missing, and a failure instead under CI=true, where it must run."""
    from mshpc.data.dali_source import dali_missing

    reason = dali_missing()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but the DALI loader cannot be tested: {reason}")
    pytest.skip(reason)
