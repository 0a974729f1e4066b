import os
from pathlib import Path

import pytest


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
