from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    """One cache folder for the embedded default corpus, prepared by the first run that needs it."""
    return tmp_path_factory.mktemp("corpus-cache")
