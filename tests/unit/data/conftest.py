"""Small real corpora and prepared datasets shared by the data tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from mshpc.data.shards import TokenDataset
from support.token_data import make_random_dataset

# In the order prepare walks them: a folder's files (sorted) before its subfolders.
_DOCS = {
    "a.txt": "hello world\n".encode(),
    "c.py": "def f(x):\n    return x + 1\n".encode(),
    "sub/b.md": "# naïve ünïcode — ok\n".encode(),
}


@pytest.fixture
def corpus_docs() -> list[bytes]:
    """The documents of `corpus`, in the order prepare reads them."""
    return list(_DOCS.values())


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of three text documents plus files prepare must skip."""
    root = tmp_path / "corpus"
    for name, data in _DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "sub" / "image.bin").write_bytes(bytes(range(256)))  # suffix not taken
    (root / "sub" / "nul.txt").write_bytes(b"text\x00with a NUL")  # binary despite its suffix
    (root / "sub" / "latin1.txt").write_bytes("café".encode("latin-1"))  # not UTF-8
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "skip.py").write_text("skipped = True\n")
    return root


@pytest.fixture
def random_dataset(tmp_path: Path) -> TokenDataset:
    """A ~6k-token dataset of 20 random-length documents in shards of 1000 tokens."""
    return TokenDataset.open(make_random_dataset(tmp_path))

